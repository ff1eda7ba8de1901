"""A rank's exception reaches the main process of a fork launch with its own type."""

from __future__ import annotations

import glob
import os
import sys
import tempfile
import textwrap
import threading

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.multiprocessing import ProcessRaisedException
from torch.utils.data import DataLoader, TensorDataset

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par.launch.lost import FOLDER_PREFIX, new_folder_name
from lightning_par.launch.processes import run_bounded
from lightning_par.strategies._rank_errors import RankErrors


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
    return set(glob.glob(os.path.join(tempfile.gettempdir(), FOLDER_PREFIX + "*")))


def test_a_ranks_exception_is_raised_in_the_main_process_with_its_type(tmp_path, monkeypatch):
    # a temporary folder of this test's own: a launch in another test running at the same
    # time (pytest-xdist) makes and removes its folder of errors in the shared one
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = error_folders()
    assert before == set()
    with pytest.raises(WrongLabels, match=r"labels must be in \[0, 10\), got 12") as caught:
        fit("user")
    # torch's report, with the rank's traceback, is the cause
    assert isinstance(caught.value.__cause__, ProcessRaisedException)
    assert "training_step" in str(caught.value.__cause__)
    if hasattr(caught.value, "__notes__"):  # the rank's own frames, as text
        (note,) = caught.value.__notes__
        assert note.startswith("(raised on rank 1; the last 8 frames of its traceback:)")
        assert "in training_step" in note and 'raise WrongLabels("labels must' in note
    assert error_folders() == before, "the launch's folder of errors must be removed"


def test_an_exception_that_cannot_be_pickled_leaves_torchs_report():
    with pytest.raises(ProcessRaisedException, match="holds a lock"):
        fit("unpicklable")


def test_rank_errors_give_back_only_a_saved_ranks_exception(tmp_path):
    errors = RankErrors(new_folder_name())
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


def test_the_first_rank_to_fail_is_raised_whichever_rank_torch_reports():
    errors = RankErrors(new_folder_name())
    try:
        errors.save(1, ValueError("boom"))  # the cause ...
        errors.save(0, RuntimeError("recv from rank 1 failed"))  # ... and a peer it took down
        got = errors.original(ProcessRaisedException("report", 0, 1234))
        assert type(got) is ValueError and got.args == ("boom",)
        if hasattr(got, "__notes__"):
            assert got.__notes__[0].startswith(
                "(raised on rank 1, the first to fail (rank 0 failed after it)"
            )
        assert type(errors.original(ProcessRaisedException("report", 1, 1234))) is ValueError
    finally:
        errors.remove()


SCRIPT = textwrap.dedent(
    """
    import traceback

    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_par


    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

        def training_step(self, batch, i):
            if self.global_rank == 1:
                raise ValueError("boom")
            return self.net(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    if __name__ == "__main__":
        trainer = pl.Trainer(
            strategy="tensor_parallel", accelerator="cpu", devices=2, max_steps=2,
            logger=False, enable_checkpointing=False, enable_progress_bar=False,
        )
        try:
            trainer.fit(Net(), DataLoader(TensorDataset(torch.ones(8, 4)), batch_size=4))
        except ValueError as error:  # what a script's log line shows: no cause, no frames
            print("ONLY:", "".join(traceback.format_exception_only(type(error), error)))
            raise
    """
)


def test_a_users_script_shows_the_failing_ranks_own_traceback(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    # forked ranks (a script on a roomier machine would get popen: each rank's own stderr)
    env = {**os.environ, "LIGHTNING_PAR_START_METHOD": "fork"}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), *sys.path])
    proc = run_bounded([sys.executable, str(script)], 240, cwd=tmp_path, env=env)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    # caught as the user's own type, its message followed by rank 1's frames ...
    only = proc.stdout[proc.stdout.index("ONLY: ValueError: boom") :]
    assert "(raised on rank 1; the last 8 frames of its traceback:)" in only, proc.stdout
    line = [s.strip() for s in SCRIPT.splitlines()].index('raise ValueError("boom")') + 1
    assert f'train.py", line {line}, in training_step' in only, proc.stdout
    assert 'raise ValueError("boom")' in only, proc.stdout
    # ... and so is the uncaught error on stderr, which ends with them
    tail = proc.stderr.rstrip().splitlines()[-4:]
    assert "in training_step" in tail[-3] and tail[-1].endswith("ValueError: boom"), tail
