"""What a scale-out starts from: the figures of the small runs that other load moves least.

On a shared machine a run's wall-clock spans hold whatever else ran beside it: a base run
slowed by another job carries its slowdown into every prediction made from it. So the
scale-out reads, from every round of the base size (``rounds`` runs of the same strategy at
``p = 2``), the figures load moves least:

* **compute**: each rank's main-thread CPU time per step (the probe's ``cpu`` clock: what
  the rank computed, blind to the time it waited for a core; a rank blocked in a receive
  sleeps), the mean over ranks, the least over rounds;
* **each traced span** (backward, a pipeline stage's ``fwd`` / ``bwd``, tensor parallelism's
  model): the CPU time its thread ran in it (the trace records it beside the wall time),
  the least over rounds; a server's turn (its process is not traced), and every span of a
  trace written before spans kept their CPU time: its wall time times its run's
  CPU-to-wall ratio of compute (the share of a core the rank had while it computed);
* **communication CPU**: the process's CPU time beyond its main thread's per step (gloo's
  threads, the bucket thread: copies, system calls, reductions), the median over rounds (it
  swings by half between rounds, load or none: the least would be a lucky one);
* **messages**: the loopback link fitted to the fastest quarter of every message size's
  transfers over all rounds (:func:`fastest_link`).

:class:`BaseNoise` says how noisy the base runs were: each round's measured step, CPU time
and the other load beside it. Runs recorded before the probes kept CPU clocks fall back to
their wall times (``Profile.cpu_based`` false).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field, replace

from lightning_par.simulate.graph import transfer_samples
from lightning_par.simulate.links import Link, fit_link
from lightning_par.simulate.ops import Compute, Graph
from lightning_par.simulate.other_load import QUIET_LOAD
from lightning_par.simulate.profile import Profile, profile
from lightning_par.simulate.replay import Run

#: Profile figures that are time spent computing (the least over rounds is kept).
SPANS = ("backward_s", "batch_s", "fwd_s", "bwd_s", "model_s", "server_s")
#: The traced spans those figures are read from, each with its CPU time in newer traces.
TIMED_SPANS = frozenset({"backward", "fwd", "bwd", "tp forward", "tp backward"})
#: The fastest share of each message size's transfers the link is fitted to.
FASTEST = 0.25


@dataclass
class BaseNoise:
    """How noisy the base runs were, one entry per round."""

    steps_s: list[float] = field(default_factory=list)  # measured step
    cpu_s: list[float | None] = field(default_factory=list)  # main-thread CPU per step
    other_load: list[float | None] = field(default_factory=list)  # cores others took

    @property
    def rounds(self) -> int:
        return len(self.steps_s)

    def as_dict(self) -> dict:
        return {"rounds": self.rounds, "steps_s": self.steps_s, "cpu_s": self.cpu_s,
                "other_load": self.other_load, "spread": spread(self.steps_s)}  # fmt: skip


def spread(values: list[float]) -> float | None:
    """``(max - min) / min`` of ``values`` (``None`` for fewer than two)."""
    values = [v for v in values if v]
    return (max(values) - min(values)) / min(values) if len(values) > 1 else None


def compute_per_step(graph: Graph) -> dict[int, float]:
    """Per rank, the wall seconds of its main lane's compute per step."""
    return {r: sum(op.seconds for op in graph.lanes[(r, "main")] if isinstance(op, Compute))
            / graph.steps for r in graph.ranks if (r, "main") in graph.lanes}  # fmt: skip


def cpu_ratio(run: Run, graph: Graph) -> float | None:
    """The share of a core ``run``'s ranks had while they computed: their main threads' CPU
    time over their main lanes' compute (wall) per step, all ranks together, at most 1.
    ``None`` where the probes kept no CPU clock."""
    cpu = run.clock_per_step("cpu")
    wall = compute_per_step(graph)
    if not cpu or not wall:
        return None
    busy = sum(wall.get(r, 0.0) for r in cpu)
    return min(1.0, sum(cpu.values()) / busy) if busy > 0 else None


def cpu_profile(run: Run, graph: Graph) -> Profile:
    """:func:`~.profile.profile` of ``run`` with its compute in CPU seconds (see the module
    docstring); its wall figures where the probes kept no CPU clock."""
    ratio = cpu_ratio(run, graph)
    cpu, process = run.clock_per_step("cpu"), run.clock_per_step("process_cpu")
    if ratio is None or not cpu:
        return profile(run, graph)
    spans = [e for t in run.traces for e in t.events if e.name in TIMED_SPANS]
    own = bool(spans) and all(e.cpu is not None for e in spans)
    prof = profile(run, graph, cpu=own)
    if not prof.traced:
        return prof
    # spans without CPU readings (older traces) and the servers' turn (an untraced
    # process): the share of a core the ranks had while they computed
    scaled = {name: getattr(prof, name) * (1.0 if own and name != "server_s" else ratio)
              for name in SPANS}  # fmt: skip
    scaled["stage_s"] = tuple(s * (1.0 if own else ratio) for s in prof.stage_s)
    compute = statistics.fmean(cpu.values())
    scaled["batch_s"] = min(scaled["batch_s"], compute)
    comm = statistics.fmean(max(process[r] - cpu[r], 0.0) for r in cpu) if process else 0.0
    return replace(prof, **scaled, compute_s=compute, comm_cpu_s=comm, cpu_based=True)


@dataclass
class Base:
    """What :func:`base_profile` reads off a strategy's base rounds."""

    profile: Profile  # each timed figure the least over rounds
    fastest: Profile  # the fastest quiet round's own figures (its model, for the offset)
    fastest_run: Run  # that round (the fastest of all where none ran beside no other load)
    noise: BaseNoise


def base_profile(runs: list[Run], link: Link) -> Base:
    """The :class:`Base` of a strategy's base runs (one per round, same size; see the module
    docstring). ``link``: the messages' link for the runs' graphs."""
    if not runs:
        raise ValueError("no base runs to build a profile from")
    profiles = [cpu_profile(run, run.graph(link)) for run in runs]
    noise = BaseNoise([run.measured_step_s or 0.0 for run in runs],
                      [p.compute_s if p.cpu_based else None for p in profiles],
                      [run.other_load for run in runs])  # fmt: skip
    # the round the offset is read from: the fastest beside no other load where one was
    # (beside load the model's own error there, not the framework's, would be carried)
    quiet = [i for i, load in enumerate(noise.other_load) if (load or 0.0) <= QUIET_LOAD]
    best = min(quiet or range(len(runs)), key=lambda i: noise.steps_s[i] or float("inf"))
    same = [p for p in profiles if p.cpu_based == profiles[best].cpu_based]
    least = {name: min(getattr(p, name) for p in same) for name in (*SPANS, "compute_s")}
    stages = {len(p.stage_s) for p in same}
    if len(stages) == 1:  # each stage at its best round
        least["stage_s"] = tuple(map(min, zip(*(p.stage_s for p in same))))
    # a rank's communication CPU swings by half between rounds of one run, beside no other
    # load as beside some (1.0 to 2.2 ms, 1.6 to 3.4): the median round, not the least
    least["comm_cpu_s"] = statistics.median(p.comm_cpu_s for p in same)
    return Base(replace(profiles[best], **least), profiles[best], runs[best], noise)


def fastest_link(runs: list[Run], fallback: Link, name: str = "loopback") -> Link:
    """The loopback link fitted to the fastest quarter (:data:`FASTEST`) of each message
    size's transfers in ``runs`` (:func:`~.graph.transfer_samples`): what a message costs
    when nothing else delays it. ``fallback`` where the runs matched no transfer."""
    by_size: dict[int, list[float]] = defaultdict(list)
    for run in runs:
        for nbytes, seconds in transfer_samples(run.traces):
            by_size[nbytes].append(seconds)
    if not by_size:
        return fallback
    fastest = []
    for nbytes, times in by_size.items():
        times.sort()
        fastest += [(nbytes, t) for t in times[: max(1, round(len(times) * FASTEST))]]
    return fit_link(fastest, name)
