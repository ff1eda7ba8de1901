"""One worker (devices=1) that fails ends the job within seconds with its error, and leaves
none of its parameter servers behind (they were once joined at the rank's exit: forever).

Every case runs in one script, one after the other (an interpreter's start-up paid once);
at its end no process of its session may be left (a server any of its fits left would
be)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from _script_runs import session_members

from lightning_par.launch.processes import run_bounded

HERE = Path(__file__).parent
SCRIPT = HERE / "_one_worker_failure_script.py"
LIMIT_S = 150  # five fits that fail in ~3 s each here, after the imports; only a hang nears it
CASES = [  # (kind, where, what the error says)
    ("parameter_server", "step", "boom in training_step"),
    ("parameter_server", "setup", "cannot run LBFGS"),
    ("parameter_server", "interrupt", "rank 0 was interrupted"),
    ("async_sgd", "step", "boom in training_step"),
    ("async_sgd", "setup", "cannot run LBFGS"),
]


def test_one_failing_worker_ends_the_job_and_its_servers():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    cases = [f"{kind}:{where}" for kind, where, _ in CASES]
    done = run_bounded([sys.executable, str(SCRIPT), *cases], LIMIT_S, env=env)
    said = done.stdout + done.stderr
    assert not done.timed_out, f"a worker failing hung:\n{said[-4000:]}"
    assert done.returncode == 7, said[-4000:]
    ended = re.findall(r"^CASE (\S+) (.*)$", done.stdout, re.M)
    assert [case for case, _ in ended] == cases, said[-4000:]
    for (_, how), (kind, where, expected) in zip(ended, CASES):
        assert how.startswith("raised after") and expected in how, (kind, where, how)
    pid = int(done.stdout.split("pid ", 1)[1].split()[0])  # its session: run_bounded's own
    assert not session_members(pid), "processes left behind"
