"""A rank's exception reaches the main process of a fork launch with its own type."""

from __future__ import annotations

import glob
import os
import tempfile
import threading

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.multiprocessing import ProcessRaisedException
from torch.utils.data import DataLoader, TensorDataset

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par.strategies._rank_errors import ERRORS_PREFIX, RankErrors


class WrongLabels(ValueError):
    """A user's own exception class (defined in the user's module, as in a notebook)."""


class RaisesOnRankOne(pl.LightningModule):
    def __init__(self, error: str):
        super().__init__()
        self.layer = nn.Linear(4, 2)
        self.error = error

    def training_step(self, batch, i):
        if self.global_rank == 1 and i == 1:
            if self.error == "unpicklable":  # a lock cannot be pickled
                raise RuntimeError("holds a lock", threading.Lock())
            raise WrongLabels("labels must be in [0, 10), got 12")
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(error: str) -> None:
    data = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=4)
    trainer = pl.Trainer(
        strategy="ring_allreduce", accelerator="cpu", devices=2, max_steps=4, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(RaisesOnRankOne(error), data)


def error_folders() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), ERRORS_PREFIX + "*")))


def test_a_ranks_exception_is_raised_in_the_main_process_with_its_type():
    before = error_folders()
    with pytest.raises(WrongLabels, match=r"labels must be in \[0, 10\), got 12") as caught:
        fit("user")
    # torch's report, with the rank's traceback, is the cause
    assert isinstance(caught.value.__cause__, ProcessRaisedException)
    assert "training_step" in str(caught.value.__cause__)
    if hasattr(caught.value, "__notes__"):
        assert caught.value.__notes__ == ["(raised on rank 1; its traceback is above)"]
    assert error_folders() == before, "the launch's folder of errors must be removed"


def test_an_exception_that_cannot_be_pickled_leaves_torchs_report():
    with pytest.raises(ProcessRaisedException, match="holds a lock"):
        fit("unpicklable")


def test_rank_errors_give_back_only_a_saved_ranks_exception(tmp_path):
    errors = RankErrors()
    try:
        errors.save(2, KeyError("no such column"))
        errors.save(3, RuntimeError("holds a lock", threading.Lock()))  # not kept
        got = errors.original(ProcessRaisedException("report", 2, 1234))
        assert type(got) is KeyError and got.args == ("no such column",)
        assert errors.original(ProcessRaisedException("report", 3, 1234)) is None
        assert errors.original(ProcessRaisedException("report", 0, 1234)) is None
        assert errors.original(RuntimeError("not a rank's report")) is None
    finally:
        errors.remove()
    assert not os.path.exists(errors.folder)
