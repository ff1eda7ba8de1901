"""A lost worker under async_sgd: rank 1 dies mid-epoch and the fit completes with every
sample trained once per epoch; rank 0 dying ends the job with a clear message; no process
is left behind."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
from test_async_sgd_work import BATCH, EPOCHS, SAMPLES, Numbered

from lightning_par.launch.lost import RankLost
from lightning_par.launch.processes import descendants
from lightning_par.strategies.async_sgd import AsyncSGDStrategy


class Trained(pl.Callback):
    """Appends each trained batch's sample numbers to rank<N>.jsonl at once (a rank that
    dies leaves what it trained)."""

    def __init__(self, out) -> None:
        self.out = out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        ids = batch[0][:, 0, 0, 0].round().long().tolist()
        with open(self.out / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps([trainer.current_epoch, ids]) + "\n")


class Dies(pl.Callback):
    """Rank ``rank`` exits abruptly when its ``at``-th batch of epoch 0 starts."""

    def __init__(self, rank: int, at: int) -> None:
        self.rank, self.at = rank, at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and batch_idx == self.at:
            os._exit(3)


def run(tmp_path, dying: int) -> None:
    torch.manual_seed(0)
    trainer = pl.Trainer(
        strategy=AsyncSGDStrategy(timeout=timedelta(seconds=20)), accelerator="cpu", devices=2,
        max_epochs=EPOCHS, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
        callbacks=[Trained(tmp_path), Dies(dying, at=2)],
    )  # fmt: skip
    trainer.fit(Numbered(width=8, num_blocks=2, scheduler=None, lr=0.01))


def _running(pid: int) -> bool:
    try:  # a zombie (exited, not yet reaped) is no running process
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def no_children_left(deadline_s: float = 10.0) -> bool:
    # (a forkserver an earlier test started, multiprocessing's resource tracker and the
    # launches' store host live for the whole session: not ours)
    from multiprocessing import forkserver, resource_tracker

    from lightning_par.launch import store_host

    helpers = {
        getattr(forkserver._forkserver, "_forkserver_pid", None),
        getattr(resource_tracker._resource_tracker, "_pid", None),
        store_host._host.process.pid if store_host._host is not None else None,
    }
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if not [p for p in descendants(os.getpid()) if p not in helpers and _running(p)]:
            return True
        time.sleep(0.2)
    return False


def trained(tmp_path) -> list[list]:
    return [
        json.loads(line) for r in range(2) if (tmp_path / f"rank{r}.jsonl").exists()
        for line in (tmp_path / f"rank{r}.jsonl").read_text().splitlines()
    ]  # fmt: skip


def test_a_lost_worker_is_survived_and_its_batches_are_trained_by_the_others(tmp_path, capfd):
    run(tmp_path, dying=1)
    err = capfd.readouterr().err
    assert "dropped worker 1 (rank 1)" in err  # the server says which one
    assert "worker 1 (rank 1) exited with code 3; the other workers go on" in err  # the launcher
    batches = trained(tmp_path)
    for epoch in range(EPOCHS):
        ids = sorted(i for e, b in batches if e == epoch for i in b)
        assert ids == list(range(SAMPLES))  # its in-flight batches were re-issued, none twice
    by_rank1 = (tmp_path / "rank1.jsonl").read_text().splitlines()
    assert len(by_rank1) == 2  # it trained two batches, then died
    assert len(batches) == EPOCHS * SAMPLES // BATCH
    assert no_children_left()


def test_losing_rank_0_ends_the_job_with_a_clear_message(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankLost, match=r"^worker 0 \(rank 0\) exited with code 3 .*cannot go on"):
        run(tmp_path, dying=0)
    assert time.monotonic() - start < 60
    assert no_children_left()
