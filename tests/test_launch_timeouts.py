"""Timeouts that fit real jobs: a long wait for a live peer, a dead one reported within
seconds naming it, two jobs at once on one machine never in one store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
from conformance.launchers import SCRIPT, results
from conformance.launchers import clean_env as _env
from every_launch_script import BATCH, STEPS, Tiny, data, one_process
from lightning.pytorch.callbacks import ModelCheckpoint
from test_parameter_server import CNN, fit
from torch.utils.data import DataLoader

from lightning_par.launch.lost import RankLost
from lightning_par.launch.processes import kill_tree
from lightning_par.launch.rendezvous import find_free_port
from lightning_par.strategies.allreduce import AllReduceStrategy
from lightning_par.strategies.parameter_server import ParameterServerStrategy


class KillsServer1(CNN):
    """Worker 0 kills server 1 outright (as the OOM killer would) at the second step."""

    def training_step(self, batch, batch_idx):
        if batch_idx == 1 and self.global_rank == 0:
            victim = next(p for p in self.trainer.strategy.servers.processes if p.server_index == 1)
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
    assert "parameter server 1 (rank 3), process" in message and "SIGKILL" in message, message
    assert "GLHF" not in message, message
    assert elapsed < 30  # start-up on a loaded machine + seconds; the timeout is 60 s


class SlowCheckpoint(Tiny):
    """Rank 0 spends ``delay`` seconds in every checkpoint, as a slow disk or a first
    compile would, while rank 1 waits for it in the barrier after the save."""

    delay = 4.0

    def on_save_checkpoint(self, checkpoint) -> None:
        if self.global_rank == 0:
            time.sleep(self.delay)


def _fit_with_checkpoints(tmp_path, timeout: timedelta | None) -> tuple[Tiny, pl.Trainer]:
    model = SlowCheckpoint()
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    trainer = pl.Trainer(
        strategy=AllReduceStrategy("ring", timeout=timeout), accelerator="cpu", devices=2,
        max_steps=STEPS, callbacks=[saver], logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(model, DataLoader(data(), batch_size=BATCH))
    return model, trainer


def test_a_rank_late_from_a_slow_checkpoint_is_not_taken_for_dead(tmp_path, monkeypatch):
    # The dead-peer limit (the old 60 s group timeout's job) is 1 s here; rank 0 spends 4 s
    # in the checkpoint hook while rank 1 waits: alive, so the job goes on.
    monkeypatch.setenv("LIGHTNING_PAR_DEAD_PEER_S", "1")
    model, _ = _fit_with_checkpoints(tmp_path, timeout=None)
    expected = one_process(2)
    diff = max((model.state_dict()[k] - expected[k]).abs().max().item() for k in expected)
    assert diff < 1e-5
    assert len(list(tmp_path.glob("*.ckpt"))) == 1  # step 2 (the run ended at step 3)


def test_the_timeout_option_still_bounds_the_wait(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_PAR_DEAD_PEER_S", "1")
    start = time.monotonic()
    with pytest.raises(Exception, match="(?i)timed out|timeout"):
        _fit_with_checkpoints(tmp_path, timeout=timedelta(seconds=2))
    assert time.monotonic() - start < 30


class FreezesRank1(Tiny):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1 and self.global_rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen: alive, connections open, silent
        return super().training_step(batch, batch_idx)


def test_a_frozen_rank_is_reported_within_seconds_naming_it(monkeypatch):
    monkeypatch.setenv("LIGHTNING_PAR_DEAD_PEER_S", "2")
    trainer = pl.Trainer(
        strategy=AllReduceStrategy("ring", timeout=timedelta(seconds=120)), accelerator="cpu",
        devices=2, max_steps=STEPS, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
    )  # fmt: skip
    start = time.monotonic()
    lost = r"^rank 1 stopped responding for [23] s .*dead_peer_timeout=2 s"
    with pytest.raises(RankLost, match=lost):
        trainer.fit(FreezesRank1(), DataLoader(data(), batch_size=BATCH))
    elapsed = time.monotonic() - start
    assert elapsed < 40  # start-up and 2 s of silence, not the 120 s timeout


def test_two_jobs_started_at_once_never_share_a_rendezvous(tmp_path):
    # Worst case of "a port found free, bound later": both jobs are told the same
    # MASTER_PORT. Each launch binds its own store on a port the OS gives it first.
    port = str(find_free_port())
    env = {**_env({"LIGHTNING_PAR_START_METHOD": "popen"}), "MASTER_PORT": port}
    jobs = [(tmp_path / f"job{i}") for i in range(2)]
    for job in jobs:
        job.mkdir()
    commands = [([sys.executable, str(SCRIPT), "2", "1", "ring_allreduce"], env)] * 2
    procs = [
        subprocess.Popen(
            cmd,
            cwd=job,
            env=e,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )  # fmt: skip
        for (cmd, e), job in zip(commands, jobs)
    ]
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=150)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()
    for proc, out in zip(procs, outs):
        assert proc.returncode == 0, out[-3000:]
        rows = results([out])
        assert sorted(r["rank"] for r in rows) == [0, 1], out[-3000:]
        assert all(r["diff"] < 1e-5 for r in rows), rows


def _beats(dead_after: float):
    import torch.distributed as dist

    from lightning_par.launch.heartbeat import Heartbeat

    store, reports = dist.HashStore(), []
    beats = [
        Heartbeat(store, r, [0, 1], dead_after, on_dead=lambda peer, text: reports.append(text))
        for r in (0, 1)
    ]
    return [b.start() for b in beats], reports


def test_the_heartbeat_reports_a_silent_peer_and_not_a_finished_one():
    (zero, one), reports = _beats(0.3)
    time.sleep(0.6)
    assert reports == []  # both beating
    one.finish()
    one._stop.set()  # finished, then gone: not reported
    time.sleep(0.8)
    assert reports == []
    (zero, one), reports = _beats(0.3)
    one._stop.set()  # frozen: no beat, not finished
    time.sleep(1.2)
    assert len(reports) == 1 and reports[0].startswith("rank 1 stopped responding for"), reports
    zero.stop()


def test_each_node_starts_its_share_of_the_servers():
    from lightning_par.paramserver.process import servers_of_node

    assert [servers_of_node(5, 2, k) for k in (0, 1)] == [[0, 2, 4], [1, 3]]
    assert servers_of_node(1, 2, 1) == []
    assert servers_of_node(3, 1, 0) == [0, 1, 2]
