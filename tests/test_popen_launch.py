"""Scripts on GPUs or many-core CPUs start their ranks with Lightning's ``popen`` launcher
(see ``choose_start_method``): the script is run again for every extra rank. Forced here
with ``LIGHTNING_PAR_START_METHOD=popen`` on a tiny model (about 8 s per strategy)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

SCRIPT = """
import sys

import lightning.pytorch as pl

import lightning_par  # noqa: F401
from lightning_par.data import CIFAR10DataModule
from lightning_par.models import CifarCNN

if __name__ == "__main__":
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(strategy=sys.argv[1], accelerator="cpu", devices=2, max_steps=3,
                         limit_val_batches=0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    model = CifarCNN(width=8, num_blocks=2)
    trainer.fit(model, datamodule=CIFAR10DataModule(source="synthetic", synthetic_size=256))
    weight = sum(float(p.double().sum()) for p in model.parameters())
    print(f"RESULT {trainer.global_rank} {trainer.global_step} {weight:.6f}", flush=True)
"""


@pytest.mark.parametrize("strategy", ["ring_allreduce", "gpipe"])
def test_strategy_trains_with_the_popen_launcher(tmp_path, strategy):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "LIGHTNING_PAR_START_METHOD": "popen"}
    out = subprocess.run(
        [sys.executable, str(script), strategy],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    results = {
        int(rank): (int(step), float(weight))
        for rank, step, weight in re.findall(r"RESULT (\d) (\d+) (\S+)", out.stdout)
    }
    assert sorted(results) == [0, 1], out.stdout  # the relaunched script ran as rank 1
    assert all(step == 3 for step, _ in results.values())
    if strategy == "ring_allreduce":  # replicas: the same weights on both ranks
        assert results[0][1] == pytest.approx(results[1][1], abs=1e-5)
