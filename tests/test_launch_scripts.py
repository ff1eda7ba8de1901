"""Strategies launched from a script, as users run them, in a fresh interpreter: a forked
rank must compute on one thread, since if the parent had already used OpenMP with several
threads, a rank with several threads hangs in its first parallel region.

(GPU scripts and many-core CPU scripts start their ranks with Lightning's ``popen``
launcher, see ``choose_start_method``: the script runs again for every extra rank. Every
strategy's user flow runs so in ``tests/test_user_flow.py``, which checks each relaunched
rank's end, its steps, and that data-parallel replicas agree.)

Each script runs in its own session; on a timeout the whole process group is killed, so a
regression fails the test instead of leaving hung ranks behind.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

TRAIN = """
import os
import sys

import lightning.pytorch as pl
import torch

import lightning_par  # noqa: F401
from lightning_par.data import CIFAR10DataModule
from lightning_par.models import CifarCNN

if __name__ == "__main__":
    strategy, parent_threads = sys.argv[1], int(sys.argv[2])
    if parent_threads > 1:  # compute first, as a notebook or script may before fit
        torch.set_num_threads(parent_threads)
        CifarCNN(width=8, num_blocks=2)(torch.randn(16, 3, 32, 32)).sum()
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=3,
                         limit_val_batches=0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    model = CifarCNN(width=8, num_blocks=2)
    initial = sum(float(p.double().sum()) for p in model.parameters())
    trainer.fit(model, datamodule=CIFAR10DataModule(source="synthetic", synthetic_size=256))
    weight = sum(float(p.double().sum()) for p in model.parameters())
    # (after a fork launch only this process reports: rank 0's weights come back to it)
    # one write per line: the ranks share stdout, and unbuffered print() writes the
    # text and its newline separately
    line = f"RESULT {trainer.global_rank} {trainer.global_step} {weight - initial:.6f}"
    sys.stdout.write(line + "\\n")
    sys.stdout.flush()
"""


def run_script(tmp_path, args: list[str], env: dict[str, str], timeout: float = 120):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    proc = subprocess.Popen(
        [sys.executable, str(script), *args], cwd=tmp_path, env={**os.environ, **env},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and every rank it started
        proc.communicate()
        pytest.fail(f"`train.py {' '.join(args)}` hung for {timeout} s (ranks killed)")
    assert proc.returncode == 0, err[-3000:]
    return {
        int(rank): (int(step), float(weight))
        for rank, step, weight in re.findall(r"RESULT (\d) (\d+) (-?\d+\.\d{6})", out)
    }


@pytest.mark.parametrize("strategy", ["ring_allreduce", "gpipe"])
def test_fork_launch_after_the_parent_used_openmp_threads(tmp_path, strategy):
    # On 2 cores, simulate a machine with more cores than ranks: with OMP_NUM_THREADS=2
    # Lightning leaves each forked rank the parent's 2 threads.
    env = {"LIGHTNING_PAR_START_METHOD": "fork", "OMP_NUM_THREADS": "2"}
    results = run_script(tmp_path, [strategy, "2"], env, timeout=90)
    assert list(results) == [0] and results[0][1] != 0.0, results  # trained, did not hang
