"""The user's flow through the command line: ``lightning-par fit`` with a strategy's options,
then ``validate``, ``test`` and ``predict`` from the checkpoint it wrote, then ``fit
--ckpt_path`` to resume; each a new ``python -m lightning_par`` process with the environment
a user has (:func:`tests.userflow.run.user_environment`). The options are typed, or in a
YAML config, or one way for the first ``fit`` and the other after it."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from lightning_par.launch.processes import run_bounded
from tests.userflow.run import user_environment

#: A small run of the example CNN on synthetic images: 4 steps an epoch (64 images, 16 a
#: batch on every rank that reads the whole batch).
COMMON = ["--model=CifarCNN", "--model.width=8", "--model.num_blocks=1",
          "--model.scheduler=null", "--data.source=synthetic", "--data.synthetic_size=72",
          "--data.batch_size=16", "--data.num_workers=0", "--trainer.accelerator=cpu",
          "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
          "--seed_everything=0"]  # fmt: skip


def run_cli(folder: Path, *argv: str, timeout: float = 200) -> str:
    """One ``lightning-par`` command in ``folder``; its output (fails the test on error)."""
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "lightning_par", *argv, *COMMON,
           f"--trainer.default_root_dir={folder}"]  # fmt: skip
    proc = run_bounded(cmd, timeout, cwd=folder, env=user_environment(folder))
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(argv)} failed:\n{text[-5000:]}"
    return text


def newest_checkpoint(folder: Path) -> Path:
    found = sorted(folder.rglob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    assert found, f"no checkpoint under {folder}"
    return found[-1]


def weights(path: Path) -> tuple[dict[str, torch.Tensor], int, bool]:
    """A checkpoint's state dict, its global step and whether it has optimiser state."""
    checkpoint = torch.load(path, weights_only=True)
    states = checkpoint.get("optimizer_states") or [{}]
    has_state = bool(states[0].get("state"))
    return checkpoint["state_dict"], checkpoint["global_step"], has_state


def cli_flow(
    folder: Path, strategy: list[str], evaluate: bool = True, then: list[str] | None = None
) -> dict:
    """fit 1 epoch -> validate, test, predict from its checkpoint (``evaluate``) -> fit to 2
    epochs from it. ``strategy``: the options that choose it (``--trainer.strategy=...`` or
    ``--config``); ``then``: other options that say the same, for every command after the
    first ``fit`` (default: ``strategy``)."""
    later = strategy if then is None else then
    text = run_cli(folder / "fit", "fit", *strategy, "--trainer.max_epochs=1",
                   "--test_after_fit=false")  # fmt: skip
    first = newest_checkpoint(folder / "fit")
    for stage in ("validate", "test", "predict") if evaluate else ():
        run_cli(folder / stage, stage, *later, f"--ckpt_path={first}")
    run_cli(folder / "resume", "fit", *later, "--trainer.max_epochs=2",
            f"--ckpt_path={first}", "--test_after_fit=false")  # fmt: skip
    resumed = newest_checkpoint(folder / "resume")
    return {"first": weights(first), "resumed": weights(resumed), "fit_output": text}
