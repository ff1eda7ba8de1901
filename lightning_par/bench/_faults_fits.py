"""Running ``bench faults``'s script (:mod:`._faults_run`) and reading each fit's output.

Every case's reference, fault-tolerant and restart fits are fits of one script, one after
the other, as cells of a notebook (the figures start at a fit's first step, so the
processes' start is in none of them); a restart's resume is the script run again, a process
of its own, since starting the processes and Lightning again is most of what a restart
costs. The time between the restart's first fit ending (``ended``) and its script started
again (``launched``), when the other cases' fits ran, is not in its time lost. A script that
ends before its last fit (a timeout, a crash) says so in the fit it was running, and the
cases it never reached run in a script of their own.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from lightning_par.bench._faults_cases import FaultCase
from lightning_par.launch.faults import FAULT_ENV
from lightning_par.launch.processes import run_bounded

RUN = "lightning_par.bench._faults_run"
APPROACHES = ("fault_tolerant", "restart")
#: The fits of the script's first run (each restart's resume is a run of its own).
FIRST = ("reference", *APPROACHES)
#: The CNN's width and residual blocks, and the batch per rank (the defaults).
MODEL = (32, 4, 32)
LIMIT_S = 600.0
#: A fit's output: ``Fits[case.name, approach]``.
Fits = dict[tuple[str, str], str]


@dataclass(frozen=True)
class Plan:
    """What every run of one benchmark does: ``steps`` in all, the fault as step ``fault``
    begins, the restart approach's checkpoint every ``every`` steps, the CNN's width and
    blocks and the batch per rank (``model``)."""

    steps: int
    fault: int
    every: int
    model: tuple[int, int, int] = MODEL
    #: ``lightning`` (Lightning chooses the launch) or ``torchrun`` (``--standalone``)
    launch: str = "lightning"
    #: the rank a rank case loses: ``last`` or ``first`` (rank 0)
    lost: str = "last"
    #: under torchrun: ``--max-restarts=1``, the lost rank replaced by a process that joins
    replace: bool = False

    @property
    def approaches(self) -> tuple[str, ...]:
        """What is measured: under torchrun the survivors alone (a restart is torchrun's
        ``--max-restarts``, the same for every strategy: measured under Lightning's launch)."""
        return APPROACHES if self.launch == "lightning" else ("fault_tolerant",)


def last_line(text: str) -> str:
    return next((line for line in reversed(text.splitlines()) if line.strip()), "(no output)")


def run_script(
    cases: list[FaultCase], approaches: tuple[str, ...], world: int, plan: Plan, folder: Path
) -> tuple[Fits, str | None]:
    """Run the script once (as a user would, a process of its own): the output of each fit
    it reached, and why it ended early (``None``: it ran every fit)."""
    sizes = ",".join(str(n) for n in plan.model)
    args = [str(world), str(plan.steps), str(plan.fault), str(plan.every), sizes, str(folder),
            ",".join(case.name for case in cases), ",".join(approaches)]  # fmt: skip
    args += [plan.lost] if plan.lost != "last" else []  # (the script's default)
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}  # (the script sets it)
    launch = [sys.executable, "-u"]
    if plan.launch == "torchrun":  # (one fit per script: a lost rank's process is gone)
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
        launch += ["--max-restarts=1"] if plan.replace else []
    done = run_bounded([*launch, "-m", RUN, *args], LIMIT_S, env=env, cwd=folder)
    parts = re.split(r"^FIT (\S+) (\w+)\n", done.stderr, flags=re.M)
    fits = {(name, approach): out for name, approach, out in zip(*[iter(parts[1:])] * 3)}
    ended = None
    if done.timed_out:
        ended = f"the script ran past {LIMIT_S:.0f} s"
    elif done.returncode != 0 or len(fits) < len(cases) * len(approaches):
        ended = f"the script ended (exit code {done.returncode}): {last_line(done.stderr)}"
    if ended and fits:  # the fit it was running says so
        fits[next(reversed(fits))] += f"\nRAISED {ended}\n"
    return fits, ended


def first_fits(cases: list[FaultCase], world: int, plan: Plan, folder: Path) -> Fits:
    """Every case's reference, fault-tolerant and restart fits, in as few scripts as go
    (under torchrun, each fit in a script of its own)."""
    fits: Fits = {}
    if plan.launch == "torchrun":
        for case in cases:
            for approach in ("reference", *plan.approaches):
                got, ended = run_script([case], (approach,), world, plan, folder)
                fits[case.name, approach] = got.get((case.name, approach), f"RAISED {ended}")
        return fits
    left = list(cases)
    while left:
        got, ended = run_script(left, FIRST, world, plan, folder)
        fits.update(got)
        reached = {name for name, _ in got}
        if not reached:  # (before its first fit: no case gets further in another script)
            fits.update({(case.name, a): f"RAISED {ended}" for case in left for a in FIRST})
            break
        left = [case for case in left if case.name not in reached]
    return fits


def resume(case: FaultCase, world: int, plan: Plan, folder: Path) -> str:
    """The output of the case's restart resumed from its newest checkpoint; the time the
    script is started is the restart's ``launched`` event (other cases' fits may have run
    since its first fit ended)."""
    own = folder / case.folder / "restart"
    own.mkdir(parents=True, exist_ok=True)
    with open(own / "steps.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"event": "launched", "t": time.time()}) + "\n")
    fits, ended = run_script([case], ("resume",), world, plan, folder)
    return fits.get((case.name, "resume"), f"RAISED {ended}")


def fit_output(fits: Fits, case: FaultCase, approach: str) -> str:
    """What the fit printed; one the script never reached says so."""
    return fits.get((case.name, approach), "RAISED the script ended before this fit")
