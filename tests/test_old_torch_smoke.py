"""A torch we claim is a torch we ran: every benchmark at its smallest and every registered
strategy for two steps on the oldest torch the machine's package index serves
(``OLD_TORCH_PINS`` in the Makefile, a second venv made by ``make old-torch-venv`` when it is
missing), through ``tests/smoke/run.py``. One test file, so that pytest-xdist runs it beside
the others (about 2.5 min, plus about 1 min for the venv the first time)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightning_par.launch.processes import run_bounded

ROOT = Path(__file__).resolve().parent.parent
OLD_VENV = ROOT / ".venv-torch213"
#: The minor version the old venv pins (the Makefile's OLD_TORCH_PINS).
OLD_TORCH = "2.13"


@pytest.mark.timeout(1800)  # (the venv, then about 20 runs; each bounded below)
def test_every_benchmark_and_strategy_runs_on_the_oldest_torch_served():
    made = run_bounded(["make", "-s", "-C", str(ROOT), "old-torch-venv"], 900)
    assert made.returncode == 0 and not made.timed_out, (made.stdout + made.stderr)[-3000:]
    # bench simulate trains ring_allreduce at 2, 3 and 4 processes (45-75 s), which the
    # strategies' rows already train: `make smoke-old-torch` runs it
    done = run_bounded(
        [str(OLD_VENV / "bin" / "python"), "-m", "tests.smoke.run", "--skip", "simulate"],
        900, cwd=ROOT,
    )  # fmt: skip
    report = done.stdout + done.stderr[-3000:]
    print(report)
    assert done.returncode == 0 and not done.timed_out, report
    assert re.search(rf"torch {re.escape(OLD_TORCH)}\.\d", done.stdout), report
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")][1:]
    assert any(r.startswith("| strategy ring_allreduce ") and "| ok |" in r for r in rows), report
    assert sum("| ok |" in r for r in rows) >= 20, report  # benchmarks and strategies ran
