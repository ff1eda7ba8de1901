"""A checkpoint path is checked in the main process before any rank starts, from a script and
from the command line: the error names the file and what is wrong with it."""

import os
import subprocess
import sys
import time

import lightning.pytorch as pl
import psutil
import pytest
import torch

from lightning_par.components import checkpoint_check
from lightning_par.components.checkpoint_check import CheckpointError, check_checkpoint
from lightning_par.data import CIFAR10DataModule
from lightning_par.models import CifarCNN


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


class _NotAllowed:  # an object weights_only loading refuses to build
    pass


@pytest.fixture
def files(tmp_path):
    good = tmp_path / "good.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "epoch": 1}, good)
    no_state = tmp_path / "weights.pt"
    torch.save({"w": torch.ones(2)}, no_state)
    truncated = _write(tmp_path / "cut.ckpt", good.read_bytes()[:200])
    custom = tmp_path / "custom.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"x": _NotAllowed()}}, custom)
    (tmp_path / "dir").mkdir()
    torch.save({"state_dict": {}}, tmp_path / "dir" / "epoch=0.ckpt")
    return {
        "good": good, "custom": custom, "no_state": no_state, "truncated": truncated,
        "missing": tmp_path / "missing.ckpt", "directory": tmp_path / "dir",
        "garbage": _write(tmp_path / "garbage.ckpt", b"\xd8\xaa)\xdb" + os.urandom(60)),
        "empty": _write(tmp_path / "empty.ckpt", b""),
        "tensor": tmp_path / "tensor.pt",
    }  # fmt: skip


BROKEN = [
    ("missing", "does not exist"),
    ("directory", "is a directory, not a checkpoint file (it holds epoch=0.ckpt)"),
    ("garbage", "is not a checkpoint (not a file torch.save wrote)"),
    ("empty", "is an empty file (0 bytes)"),
    ("no_state", "is not a Lightning checkpoint: it holds a dict without 'state_dict'"),
    ("truncated", "is truncated or corrupt"),
    ("tensor", "is not a Lightning checkpoint: it holds a Tensor"),
]


@pytest.mark.parametrize("name, problem", BROKEN, ids=[b[0] for b in BROKEN])
def test_a_broken_checkpoint_is_named_with_its_problem_and_the_fix(files, name, problem):
    torch.save(torch.ones(2), files["tensor"])
    with pytest.raises(CheckpointError) as error:
        check_checkpoint(files[name])
    message = str(error.value)
    assert f"ckpt_path='{files[name]}' {problem}" in message, message
    assert "ckpt_path='last'" in message and isinstance(error.value, ValueError)


def test_an_unreadable_file_is_named(files, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(checkpoint_check, "open", refuse, raising=False)
    with pytest.raises(CheckpointError, match=r"good.ckpt' cannot be read \(Permission denied\)"):
        check_checkpoint(files["good"])


def test_a_checkpoint_and_lightnings_own_paths_pass(files):
    for path in (files["good"], str(files["good"]), files["custom"], None, "last", "best", "hpc"):
        check_checkpoint(path)  # custom: weights_only refuses its objects; Lightning decides


def _fit(ckpt_path) -> None:
    trainer = pl.Trainer(
        strategy="ring_allreduce", devices=2, accelerator="cpu", max_steps=1, logger=False,
        enable_progress_bar=False, enable_checkpointing=False,
    )  # fmt: skip
    data = CIFAR10DataModule(source="synthetic", synthetic_size=64, batch_size=16)
    trainer.fit(CifarCNN(width=8, num_blocks=1), datamodule=data, ckpt_path=ckpt_path)


@pytest.mark.parametrize("name", ["missing", "garbage"])
def test_fit_from_a_script_refuses_a_broken_checkpoint_before_starting_a_rank(files, name):
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # earlier tests'
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=str(files[name])):
        _fit(files[name])
    assert time.monotonic() - start < 5  # a launch takes longer than this
    started = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not started  # no rank was started


def test_the_command_line_prints_one_line_naming_the_file(files, tmp_path):
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "lightning_par", "fit", "--model=CifarCNN",
         "--data.source=synthetic", "--trainer.accelerator=cpu", "--trainer.devices=2",
         "--trainer.strategy=ring_allreduce", f"--trainer.default_root_dir={tmp_path / 'logs'}",
         f"--ckpt_path={files['empty']}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.startswith(
        f"python -m lightning_par: error: ckpt_path='{files['empty']}' is an empty file"
    ), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert not (tmp_path / "logs").exists() and time.monotonic() - start < 60


def test_a_launcher_sees_the_ckpt_path_lightning_passes_to_it() -> None:
    # what Lightning's call._call_and_handle_interrupt hands a launcher, for each method
    from lightning.pytorch.trainer import call

    from lightning_par.strategies._launchers import launch_arguments

    seen = {}

    class Launcher:
        def launch(self, function, *args, trainer=None, **kwargs):
            seen[function.__name__] = launch_arguments(function, args, kwargs)

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False)
    trainer.strategy._launcher = Launcher()
    call._call_and_handle_interrupt(trainer, trainer._fit_impl, "model", None, None, None, "a.ckpt")
    call._call_and_handle_interrupt(trainer, trainer._validate_impl, "model", None, "b.ckpt")
    assert seen["_fit_impl"]["ckpt_path"] == "a.ckpt" and seen["_fit_impl"]["model"] == "model"
    assert seen["_validate_impl"]["ckpt_path"] == "b.ckpt"
