"""How long this machine's scheduler leaves a core idle: the ``delay_s`` of
:func:`.cores.placement_wait`, read off ranks that train and meet.

Ranks that cannot be placed evenly on the cores (3 on 2) start as one alone and two sharing a
core; the lone one reaches the meeting first and sleeps there, and its core idles until the
load balancer moves one of the pair onto it. :mod:`.sharing_cost` runs ``p`` ranks of the
model's own training step, meeting in a small allreduce after each (the shape of a
data-parallel step), and the same steps with a core to each rank: fair processor sharing
would make the crowded step ``p / cores`` times a rank's CPU per step, plus what meeting
costs alone; what it takes beyond that is :func:`.cores.placement_wait`, which
:func:`delay_from_laps` inverts for the delay.

It used to be read off a tiny matrix loop of 10 to 40 ms, which fit in a core's L1 cache:
3.3, 8.6 and 0 ms in three quiet validations of this session, while their 3-worker rows
waited 4 to 7 ms more per step than their 4-worker rows. The model's own step holds the
working set the runs have. Other processes spoil a trial: their load slows the crowded
loop as placement would (beside one other busy core the estimate read 13.6 and 61 ms), so
each trial also measures the cores' worth of CPU other processes took while it ran
(:func:`loop_other_load`), and :mod:`.sharing_cost` keeps only trials beside less than
:data:`QUIET_LOAD` of it.
"""

from __future__ import annotations

from lightning_par.simulate.cores import placement_wait

#: Cores' worth of other processes' CPU a trial may run beside and still count as quiet.
QUIET_LOAD = 0.25


def loop_other_load(ranks: list[dict]) -> float:
    """Cores' worth of CPU other processes took while ``ranks`` ran (each rank's ``cpu``
    seconds of its process, its ``wall`` seconds, rank 0's reading of the machine's ``busy``
    CPU seconds: the machine's busy time less the ranks' own, as
    :func:`lightning_par.measure.probe.other_load` reads a run's); 0 where the machine's busy
    time is unknown."""
    busy = ranks[0].get("busy")
    if busy is None or ranks[0]["wall"] <= 0:
        return 0.0
    return max(busy - sum(r["cpu"] for r in ranks), 0.0) / ranks[0]["wall"]


def delay_from_excess(excess_s: float, work_s: float, cores: int, ranks: int | None = None,
                      threads: int = 1) -> float:  # fmt: skip
    """The ``delay_s`` at which ``ranks`` (default ``cores + 1``) ranks of ``work_s`` lose
    ``excess_s`` to placement (:func:`.cores.placement_wait` inverted by bisection; it grows
    with the delay until a freed core is never taken in time, where the answer is that
    bound)."""
    ranks = ranks or cores + 1
    if excess_s <= 0:
        return 0.0
    hi = 2 * work_s * ranks
    if placement_wait(work_s, ranks, cores, threads, hi) <= excess_s:
        return hi
    lo = 0.0
    for _ in range(50):
        mid = (lo + hi) / 2
        short = placement_wait(work_s, ranks, cores, threads, mid) < excess_s
        lo, hi = (mid, hi) if short else (lo, mid)
    return (lo + hi) / 2


def delay_from_laps(lap_s: float, cpu_s: float, meet_s: float, ranks: int, cores: int,
                    threads: int = 1) -> float | None:  # fmt: skip
    """The delay read off ``ranks`` ranks that each ran ``cpu_s`` of CPU a step and met in
    ``lap_s`` a step on ``cores`` (``meet_s``: what meeting adds a step with a core to each
    rank): their lap beyond fair sharing's, inverted (:func:`delay_from_excess`). ``None``
    where the ranks can be placed evenly: nothing waits there, and nothing can be read."""
    n = ranks * threads
    if n <= cores or n % cores == 0:
        return None
    fair = n / cores * cpu_s / threads
    return delay_from_excess(lap_s - meet_s - fair, cpu_s, cores, ranks, threads)
