"""Faults: a dead server, a dead worker or a hung worker ends the job within the timeout, with
a message naming the role and rank, and leaves no process behind."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
from test_parameter_server import CNN, fit

from lightning_par.launch.faults import FAULT_ENV
from lightning_par.launch.processes import descendants
from lightning_par.launch.store_host import job_store_host
from lightning_par.strategies.parameter_server import ParameterServerStrategy

TIMEOUT = timedelta(seconds=6)


def _live_descendants() -> set[int]:
    alive = set()
    for pid in descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":  # a zombie has exited; only its parent's reaping is left
            alive.add(pid)
    return alive


def _assert_nothing_left(before: set[int]) -> None:
    deadline = time.monotonic() + 5  # kills are asynchronous; servers poll every 0.5 s
    while (left := _live_descendants() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left behind: {left}"


def _failing_fit(model, servers: int = 2):
    job_store_host()  # the launching process's store host lives as long as it does, by design
    before = _live_descendants()
    strategy = ParameterServerStrategy(num_servers=servers, timeout=TIMEOUT)
    start = time.monotonic()
    with pytest.raises(Exception) as info:
        fit(model, strategy, 2)
    elapsed = time.monotonic() - start
    _assert_nothing_left(before)
    return str(info.value), elapsed


def _model(cls):
    torch.manual_seed(0)
    model = cls(width=8, num_blocks=2, scheduler=None)
    model.global_batch = 8
    return model


class DiesAtStep2(CNN):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1 and self.global_rank == 1:
            os._exit(3)
        return super().training_step(batch, batch_idx)


class HangsAtStep2(CNN):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1 and self.global_rank == 1:
            time.sleep(3600)
        return super().training_step(batch, batch_idx)


def test_a_dead_worker_ends_the_job_and_its_servers():
    message, elapsed = _failing_fit(_model(DiesAtStep2))
    assert message.startswith("worker 1 (rank 1) exited with code 3; every rank was stopped")
    assert elapsed < 60


def test_a_dead_server_ends_the_job_naming_it(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "exit:server=1:step=1:code=7")  # as step 1 begins
    message, elapsed = _failing_fit(_model(CNN))
    assert "parameter server 1 (rank 3)" in message, message
    assert elapsed < 60  # start-up (seconds on a loaded box) + well under one timeout


def test_a_hung_worker_ends_the_job_within_the_timeout_naming_it():
    message, elapsed = _failing_fit(_model(HangsAtStep2))
    assert "worker 1 (rank 1)" in message and "hangs" in message, message
    # start-up, one timeout until the server names the worker, a short grace on worker 0
    assert elapsed < 60
