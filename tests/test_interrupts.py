"""An interrupt of the main process (Ctrl-C, Jupyter's "interrupt kernel", SIGTERM from a
scheduler) stops every rank within seconds, leaves no process behind, and says where the
newest checkpoint is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from _script_runs import session_members  # noqa: E402

SCRIPT = """
import os, sys, time
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset
import lightning_par
from lightning_par.strategies.allreduce import AllReduceStrategy

class Slow(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
    def training_step(self, batch, i):
        if i == 2:  # every rank is in the loop: tell the test who we are
            open(os.path.join(sys.argv[1], f"rank{self.global_rank}.pid"), "w").write(
                str(os.getpid()))
        time.sleep(0.2)
        return self.layer(batch[0]).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

if __name__ == "__main__":
    data = TensorDataset(torch.randn(4000, 4))
    trainer = pl.Trainer(
        strategy=AllReduceStrategy("ring", start_method=sys.argv[2],
                                   fault_tolerant="fault_tolerant" in sys.argv[3:]),
        accelerator="cpu",
        devices=2, max_epochs=1, logger=False, enable_progress_bar=False,
        default_root_dir=sys.argv[1],
    )
    trainer.fit(Slow(), DataLoader(data, batch_size=2))
"""


def _as_a_shell_starts_it() -> None:
    """The script starts as a terminal starts a program: SIGINT and SIGTERM at their default
    and no signal blocked, whatever this test process inherited or was left with."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) is no running process
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


INTERRUPTS = [  # start method, signal, fault_tolerant (popen: rank 0 behind a keeper),
    # to the whole process group (Ctrl-C in a terminal) or to the main process alone
    ("fork", signal.SIGINT, False, False),
    ("fork", signal.SIGTERM, False, False),
    ("popen", signal.SIGTERM, False, False),
    ("popen", signal.SIGTERM, True, False),
    ("popen", signal.SIGINT, True, True),
]


@pytest.mark.parametrize(
    "start_method, signum, fault_tolerant, group", INTERRUPTS,
    ids=[f"{m}-{s.name}" + "-fault_tolerant" * f + "-group" * g for m, s, f, g in INTERRUPTS],
)  # fmt: skip
def test_an_interrupt_of_the_main_process_stops_every_rank(
    tmp_path, start_method, signum, fault_tolerant, group
):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LIGHTNING_PAR_TIMEOUT": "60"}
    tolerant = "fault_tolerant" if fault_tolerant else "-"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), start_method, tolerant], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        preexec_fn=_as_a_shell_starts_it,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("rank*.pid"))) < 2:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the ranks never started training"
            time.sleep(0.2)
        pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
        if group:  # every process of the script's group, as a terminal's Ctrl-C
            os.killpg(proc.pid, signum)
        else:  # the main process only, as Jupyter or a scheduler does
            proc.send_signal(signum)
        start = time.monotonic()
        out = proc.communicate(timeout=30)[0]
        while any(_alive(p) for p in pids) and time.monotonic() - start < 10:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], f"ranks still running:\n{out[-3000:]}"
        while session_members(proc.pid) and time.monotonic() - start < 10:
            time.sleep(0.1)  # (the job's store host ends as its launcher did)
        assert session_members(proc.pid) == [], out[-3000:]
        assert time.monotonic() - start < 10
        assert "Traceback" not in out, out[-3000:]
        assert "go on without it" not in out, out[-3000:]  # (no rank was lost)
        assert "lightning_par: stopped every rank" in out, out[-3000:]
        assert "no checkpoint was saved" in out  # the epoch never ended
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_command_ended_by_sigterm_leaves_no_temporary_folder_and_no_process(tmp_path):
    """``python -m lightning_par.compare`` ended by ``kill`` (SIGTERM) as its runs train, as
    ``timeout`` or a scheduler ends it: it stops the runs it started the same way, and its
    temporary folders and theirs go with them, as on Ctrl-C."""
    private = tmp_path / "tmp"
    private.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(private)}
    cmd = [sys.executable, "-m", "lightning_par.compare", "--strategies", "ring_allreduce",
           "--rounds", "20", "--data", "synthetic", "--out", str(tmp_path / "out")]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not any(p.name.startswith("lightning_par-weights-") for p in private.rglob("*")):
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no run started training"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # the command's own process, as `kill PID`
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert session_members(proc.pid) == []
    left = sorted(p.name for p in private.iterdir() if not p.name.startswith("torchinductor"))
    assert left == [], left
