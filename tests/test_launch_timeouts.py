"""Timeouts that fit real jobs: a long wait for a live peer, a dead one reported within
seconds naming it, two jobs at once on one machine never in one store."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch
from test_parameter_server import CNN, fit

from lightning_par.strategies.parameter_server import ParameterServerStrategy


class KillsServer1(CNN):
    """Worker 0 kills server 1 outright (as the OOM killer would) at the second step."""

    def training_step(self, batch, batch_idx):
        if batch_idx == 1 and self.global_rank == 0:
            victim = next(p for p in self.trainer.strategy._servers if p.server_index == 1)
            os.kill(victim.pid, signal.SIGKILL)
        return super().training_step(batch, batch_idx)


def test_a_server_killed_outright_ends_the_job_within_seconds_naming_it():
    torch.manual_seed(0)
    model = KillsServer1(width=8, num_blocks=2, scheduler=None)
    model.global_batch = 8
    strategy = ParameterServerStrategy(num_servers=2, timeout=timedelta(seconds=60))
    start = time.monotonic()
    with pytest.raises(Exception) as info:
        fit(model, strategy, 2, steps=4)
    elapsed = time.monotonic() - start
    message = str(info.value)
    print(message)
    assert "parameter server 1 (rank 3, pid" in message and "SIGKILL" in message, message
    assert "GLHF" not in message, message
    assert elapsed < 30  # start-up on a loaded machine + seconds; the timeout is 60 s
