"""The summary line names the registered strategy; the estimate rounds its clock time."""

import time
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest

from lightning_par.summary import FitTimeEstimate, strategy_label


@pytest.mark.parametrize(
    "name", ["ring_allreduce", "tree_allreduce", "round_robin_allreduce", "gpipe", "async_sgd",
             "local_sgd", "lightning_ddp"],
)  # fmt: skip
def test_strategy_label_is_the_registered_name(name):
    trainer = pl.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    assert strategy_label(trainer.strategy) == name


def test_strategy_label_of_lightnings_own_strategies():
    single = pl.Trainer(accelerator="cpu", devices=1, logger=False).strategy
    assert strategy_label(single) == "single_device"
    ddp = pl.Trainer(strategy="ddp_spawn", accelerator="cpu", devices=2, logger=False).strategy
    assert strategy_label(ddp) == "ddp_spawn"


def test_the_estimate_rounds_the_finish_to_the_nearest_minute(monkeypatch):
    trainer = SimpleNamespace(
        num_training_batches=100, max_epochs=1, max_steps=-1, accumulate_grad_batches=1,
        num_val_batches=[], val_check_batch=100, check_val_every_n_epoch=1,
    )  # fmt: skip
    estimate = FitTimeEstimate(after_batches=20)
    estimate._seen, estimate.train_batches, estimate.train_seconds = 20, 10, 1.0  # 0.1 s each
    now = time.mktime((2026, 11, 24, 10, 0, 0, 0, 0, -1))
    monkeypatch.setattr(time, "time", lambda: now)
    # 100 batches x 0.1 s = 10 s, 0 s elapsed: done at 10:00:10 -> "10:00"
    assert "(done around 10:00)" in estimate.estimate_line(trainer, elapsed=0.0)
    # 10 s + 40 s: 10:00:50 reads 10:01, not 10:00
    assert "(done around 10:01)" in estimate.estimate_line(trainer, elapsed=-40.0)
