"""The machine a validation measured on: its cores, the threads each rank computed on, and,
read off ranks that train the model and meet (:mod:`.sharing_cost`), the model's step at
each size's batch and what taking turns on a core costs it.

:func:`measure_machine` reads them before the validation trains;
:mod:`lightning_par.simulate.validate` records them in each run's ``row.json``, so
``--validate --reuse`` on another machine or shell reads the machine the runs had
(:func:`recorded_machine`), not its own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

from lightning_par.simulate.cores import lightning_threads
from lightning_par.simulate.replay import Run
from lightning_par.simulate.sharing_cost import measure_step_cpu


class Machine(NamedTuple):
    cores: int
    threads: int  # intra-op threads per rank
    #: per size whose ranks outnumber the cores: CPU per step over a core each's
    sharing_cost: dict[int, float] = {}  # a NamedTuple's default, never changed
    #: per size: the model's training step on that size's batch, a core each (CPU seconds)
    step_cpu: dict[int, float] = {}
    #: what could not be measured: every trial of it ran beside other processes' load
    unmeasured: tuple[str, ...] = ()

    def as_row(self) -> dict:
        """What :mod:`lightning_par.simulate.validate` records in each ``row.json``."""
        return {"cores": self.cores, "threads": self.threads,
                "sharing_cost": {str(p): c for p, c in self.sharing_cost.items()},
                "step_cpu": {str(p): c for p, c in self.step_cpu.items()},
                "unmeasured": list(self.unmeasured)}  # fmt: skip


def measure_machine(sizes: tuple[int, ...], model: str, global_batch: int) -> Machine:
    """This machine, for training ``model`` at ``global_batch`` on each of ``sizes`` ranks."""
    cores = os.cpu_count() or 1
    threads = measured_threads(cores, sizes[0])
    steps = measure_step_cpu(model, global_batch, sizes, cores, threads)
    unmeasured = () if steps.alone else ("step CPU at each size, cost of turns",)
    return Machine(cores, threads, steps.cost, steps.alone, unmeasured)


def kept_machine(found: dict[tuple[str, int], list[Path]]) -> Machine:
    """:func:`recorded_machine` of a validation's run folders, from their ``row.json``."""
    kept = [Run(name, [], None, row=json.loads((f / "row.json").read_text()))
            for (name, _), folders in found.items() for f in folders[:1]
            if (f / "row.json").exists()]  # fmt: skip
    return recorded_machine(kept)


def recorded_machine(runs: list[Run], cores: int | None = None, threads: int | None = None,
                     sizes: tuple[int, ...] = (2, 3, 4)) -> Machine:  # fmt: skip
    """The machine that measured ``runs``: as given, else as :func:`measure_machine`
    recorded it in the runs' ``row.json``, else this machine's cores and threads now (no
    timed step or cost of sharing cores: runs from before they were measured)."""
    recorded = next((run.row for run in runs if "cores" in run.row), {})
    cores = cores or recorded.get("cores") or os.cpu_count() or 1
    threads = threads or recorded.get("threads") or measured_threads(cores, sizes[0])
    cost = {int(p): c for p, c in (recorded.get("sharing_cost") or {}).items()}
    alone = {int(p): c for p, c in (recorded.get("step_cpu") or {}).items()}
    return Machine(cores, threads, cost, alone, tuple(recorded.get("unmeasured") or ()))


def measured_threads(cores: int, first: int = 2, env: dict | None = None) -> int:
    """Intra-op threads each rank of a validation's runs computed on: ``OMP_NUM_THREADS``
    where the user set it, else what Lightning picked for the first row (``first`` ranks).
    All rows run in one process and Lightning sets ``OMP_NUM_THREADS`` there on its first
    launch, so the 3- and 4-worker rows keep that choice."""
    env = os.environ if env is None else env
    given = env.get("OMP_NUM_THREADS", "")
    return int(given) if given.isdigit() and int(given) > 0 else lightning_threads(first, cores)
