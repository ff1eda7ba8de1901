"""Compute that shares a machine's cores: processor sharing for the simulator's lanes.

When more ranks compute at once than the machine has cores (3 or 4 ranks on this project's
2-core machine), the operating system's scheduler gives each runnable thread a fair share
of the cores (Linux CFS; the processor-sharing queue of Kleinrock, "Queueing Systems",
vol. 2, 1976, section 4.4). A compute span that overlaps others on average ``n`` threads'
worth then takes ``max(1, n / cores)`` times its own work.

Threads per rank follow the launch: Lightning gives each of ``p`` ranks
``max(1, cores // p)`` intra-op threads when ``OMP_NUM_THREADS`` is unset
(``lightning.fabric.utilities.distributed._suggested_max_num_threads``, called by its
multiprocessing launcher that :class:`lightning_par.strategies._launchers.PolicyLauncher`
extends), and it then sets ``OMP_NUM_THREADS``, so later runs of the same process keep the
first run's choice; forked ranks compute on one thread
(:func:`lightning_par.comm.launch.limit_threads_after_fork`). A rank blocked in a receive
sleeps in the kernel (gloo waits on its socket) and takes no core: only compute spans count.

:func:`stretches` is one round of the fixed point that :func:`.engine.simulate` iterates:
given where every compute span ran, how much longer each one takes. A lane may stand for
several identical ranks (``Graph.weight``: the data-parallel scale-out graphs draw one rank
for all ``p``); its spans then count that many times.

Processor sharing is fair only on average: the scheduler runs each thread on one core, so
3 equal ranks on 2 cores start as one alone and two sharing, and a core the lone rank leaves
idle at the allreduce could stay idle until the load balancer moves one of the pair there.
An earlier model charged that wait, with a delay read off ranks that meet once a step; the
data-parallel training runs showed none of it (issue #42: on two quiet validations of a
2-core machine, every 3-worker row a step as short as fair sharing and the cost of turns
predict, -0.6 to +9 %, while the delay of 5.4 and 9.5 ms predicted them 6 to 20 % long).
What placement does cost a data-parallel rank shows in its CPU, and is in the cost of turns.

Pipeline stages do unequal work, and there where whole ranks run decides the step: the
compare's CifarCNN at 4 stages is two heavy stages (46 and 42 ms of CPU a step here) and two
light ones (16 and 9 ms). Shared evenly over both cores, the model let the heavy stages
borrow the light ones' idle share of the other core; the scheduler keeps each on one core,
beside one light stage, where it waits for that one. Such graphs (``Graph.placed``) are
replayed with their ranks placed whole, each span sharing only its own core, once for each
placement a run may land on (:func:`balanced_placements`: the two heavy stages each beside
a light one, either way round, 71 and 82 ms a step), and the step expected is their mean
weighed by how long the load balancer leaves each alone. On one quiet run of this machine
gpipe 2 -> 4 went from 10.7 % short to within 1 %, 2 -> 3 from 2.9 % short to 1.2 % over.

What fair sharing of the ranks' compute alone missed (issue #42), and is here now:

* **other processes**: the cores' worth they take while the ranks run leaves the ranks
  fewer (:func:`capacity`; each measured run records it, :func:`lightning_par.measure.
  probe.other_load`);
* **messages**: over loopback moving bytes is the ranks' own CPU, so the engine shares the
  cores with :class:`~.ops.Comm` spans ``on_cores`` too;
* **taking turns costs CPU**: ranks that take turns on a core evict each other's caches and
  are moved between cores, so their work grows (:func:`turn_factor`, measured by
  :mod:`.sharing_cost`).
"""

from __future__ import annotations

import itertools


def lightning_threads(ranks: int, cores: int) -> int:
    """Intra-op threads per rank that Lightning's launcher picks for ``ranks`` on ``cores``."""
    return max(1, cores // max(1, ranks))


def stretches(
    computes: dict[tuple, tuple[float, float, float]],
    weight: dict[int, float],
    cores: int,
    threads: int = 1,
    other_load: float = 0.0,
    placed: dict[int, int] | None = None,
) -> dict[tuple, float]:
    """Per compute span ``(lane, op) -> (start, end, own seconds)``: how many times its own
    work it takes when every span shares ``cores`` with those it overlaps (time-averaged
    threads at once, its own included, over the cores left by ``other_load``: see
    :func:`capacity`; at least 1). ``placed`` (rank -> core, :func:`place`): each span
    shares only its own core, with the spans of the ranks placed there."""
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    left = capacity(cores, other_load)
    if placed is not None:
        left /= cores  # one core each, less its part of the other load

    def core(key: tuple) -> int:
        return placed.get(key[0][0], 0) if placed is not None else 0

    items = [(key, a, b, weight.get(key[0][0], 1) * threads, core(key)) for key, (a, b, _)
             in computes.items() if b > a]  # fmt: skip
    out: dict[tuple, float] = {}
    for key, a, b, _, at in items:
        busy = sum(w * (min(b, d) - max(a, c)) for _, c, d, w, on in items
                   if c < b and d > a and on == at)  # fmt: skip
        out[key] = max(1.0, busy / (b - a) / left)
    return out


#: How far the busiest core's load may exceed the least busy one's before Linux's load
#: balancer moves a task (``imbalance_pct`` 117 of the scheduler domain of a package's
#: cores, ``sd_init`` in ``kernel/sched/topology.c``).
IMBALANCE = 1.17
#: Most placements of whole ranks on the cores tried (beyond it, only :func:`place`'s).
MAX_PLACEMENTS = 64


def place(work: dict[int, float], cores: int) -> dict[int, int]:
    """Rank -> core for ranks of unequal ``work`` (CPU seconds a step), each placed whole
    on one core as the scheduler places threads, the busiest first on the core with the
    least so far (Graham's longest-processing-time rule, "Bounds on multiprocessing timing
    anomalies", 1969)."""
    load = [0.0] * max(cores, 1)
    out = {}
    for rank in sorted(work, key=lambda r: (-work[r], r)):
        at = min(range(len(load)), key=lambda c: (load[c], c))
        out[rank] = at
        load[at] += work[rank]
    return out


def balanced_placements(work: dict[int, float], cores: int
                        ) -> list[tuple[float, dict[int, int]]]:  # fmt: skip
    """The placements of whole ranks on ``cores`` a run may land on, each with its weight:
    Linux's load balancer leaves a placement alone while no core's load exceeds another's
    by more than :data:`IMBALANCE`, and moves a task off it the sooner the more it does, so
    a placement's weight falls from 1 (loads equal) to 0 (one core :data:`IMBALANCE`
    squared times the other's): the 4-stage pipeline's two heavy stages each beside one
    light stage, either way round, both weigh about as much; the two heavy ones on one core,
    nothing. A hard cut at the margin made the prediction jump by 8 % when a stage's timing
    moved by a few per cent. Each core busy; the first rank on core 0 (the cores are alike);
    beyond :data:`MAX_PLACEMENTS` only :func:`place`'s. Weights sum to 1."""
    ranks = sorted(work)
    if cores < 2 or len(ranks) <= cores:
        return [(1.0, {r: i for i, r in enumerate(ranks)})]
    if cores ** (len(ranks) - 1) > MAX_PLACEMENTS:
        return [(1.0, place(work, cores))]
    found = []
    for rest in itertools.product(range(cores), repeat=len(ranks) - 1):
        at = dict(zip(ranks, (0, *rest)))
        load = [sum(work[r] for r in ranks if at[r] == c) for c in range(cores)]
        if min(load) > 0:
            ratio = max(load) / min(load)
            found.append((max(0.0, 1.0 - (ratio - 1.0) / (IMBALANCE**2 - 1.0)), at))
    total = sum(w for w, _ in found)
    if total <= 0:  # none near balance: the best that can be done
        return [(1.0, place(work, cores))]
    return [(w / total, at) for w, at in found if w > 0]


def turn_factor(stretch: float, turn_cost: tuple[float, float] | None) -> float:
    """How many times its own CPU a compute span takes for taking turns on the cores
    (:mod:`.sharing_cost`): ``turn_cost`` is ``(cost, at)``, the cost measured where the
    ranks shared the cores ``at`` times over (``p`` data-parallel ranks on ``cores``: ``p /
    cores``); a span that the ranks alone make share them ``stretch`` times over pays that
    share of it (a pipeline stage that mostly computes while others wait pays little), one
    that shares nothing pays nothing. Other processes' share is left out: it was there
    when the base run measured its CPU time, too."""
    if turn_cost is None or stretch <= 1.0:
        return 1.0
    cost, at = turn_cost
    share = min((stretch - 1.0) / (at - 1.0), 1.0) if at > 1.0 else 1.0
    return 1.0 + (cost - 1.0) * share


def capacity(cores: int, other_load: float = 0.0) -> float:
    """Cores' worth left to the ranks when other processes took ``other_load`` cores' worth
    of CPU while they ran (:func:`lightning_par.measure.probe.other_load` measures it): a
    scheduler sharing fairly gives the rest to the ranks. Never below a tenth of a core:
    a rank that ran at all got some."""
    return max(cores - max(other_load, 0.0), 0.1)
