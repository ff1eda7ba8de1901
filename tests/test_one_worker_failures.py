"""One worker (devices=1) that fails ends the job within seconds with its error, and leaves
none of its parameter servers behind (they were once joined at the rank's exit: forever)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from _script_runs import session_members

from lightning_par.launch.processes import run_bounded

HERE = Path(__file__).parent
SCRIPT = HERE / "_one_worker_failure_script.py"
LIMIT_S = 90  # a fork launch fails in ~8 s here; only a hang comes near this


@pytest.mark.parametrize(
    "kind,where,expected",
    [
        ("parameter_server", "step", "boom in training_step"),
        ("parameter_server", "setup", "cannot run LBFGS"),
        ("parameter_server", "interrupt", "rank 0 was interrupted"),
        ("async_sgd", "step", "boom in training_step"),
        ("async_sgd", "setup", "cannot run LBFGS"),
    ],
)
def test_one_failing_worker_ends_the_job_and_its_servers(kind, where, expected):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    done = run_bounded([sys.executable, str(SCRIPT), kind, where], LIMIT_S, env=env)
    assert not done.timed_out, f"{kind} with one worker failing at {where} hung:\n{done.stderr}"
    assert done.returncode == 7, done.stdout + done.stderr
    assert "raised after" in done.stdout and expected in done.stdout + done.stderr
    pid = int(done.stdout.split("pid ", 1)[1].split()[0])  # its session: run_bounded's own
    assert not session_members(pid), "processes left behind"
