"""Measure how long this machine's scheduler leaves a core idle: the ``delay_s`` of
:func:`.cores.placement_wait`.

``cores + 1`` single-threaded ranks compute the same work and meet in a small allreduce, over
and over (the shape of a data-parallel step with nothing else in it); ``cores`` ranks do the
same, one to a core, for the cost of meeting. Fair processor sharing would make the first
loop ``(cores + 1) / cores`` times the second's work longer; what it takes beyond that is
:func:`.cores.placement_wait`, which :func:`delay_from_excess` inverts for the delay. The
median over a few work sizes is the estimate (the scheduler's timing is noisy on a busy
machine: medians of rounds, sizes and three trials). Other processes spoil a trial: their
load slows the crowded loop as placement would, and the estimate came out at 13.6 ms beside
one other busy core where quiet trials read 3-6 ms. So each trial also measures the cores'
worth of CPU other processes took while its loops ran (the machine's busy time less the
ranks' own, :func:`lightning_par.measure.probe.other_load`'s reading); a trial beside more
than :data:`QUIET_LOAD` of it is run again, a few times at most, and where none was quiet
the delay is not measured (``None``): the least disturbed of such trials read 61 ms.

On this project's 2-core machine 3 ranks of 10 to 40 ms each took 3 to 7 ms longer per
meeting than fair sharing (``python -m lightning_par.simulate --validate`` records the
estimate with its runs).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from lightning_par.launch import run_on_ranks
from lightning_par.measure.probe import machine_busy_s
from lightning_par.simulate.cores import placement_wait

#: Work per meeting (seconds alone), spanning a CIFAR step's compute on this machine.
WORK_S = (0.01, 0.02, 0.04)
#: Cores' worth of other processes' CPU a trial may run beside and still count as quiet.
QUIET_LOAD = 0.25


def _work(reps: int, size: int = 64) -> None:
    a = torch.full((size, size), 0.5)
    for _ in range(reps):
        a = torch.tanh(a @ a * 0.01)


def _units_per_second() -> float:
    """How many :func:`_work` units one thread runs per second here (the caller's thread
    count is restored)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _work(20)
        start = time.perf_counter()
        _work(400)
        return 400 / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)


def _meet_loop(rank: int, world: int, reps: list[int], rounds: int) -> dict:
    """Per work size (``sizes``): the median round's seconds and the median own compute's
    on this rank (medians: one round that another process interrupts moves neither); and,
    over the whole loop, this rank's process CPU time (``cpu``), the wall time (``wall``)
    and the machine's busy CPU time (``busy``, rank 0 only)."""
    torch.set_num_threads(1)
    token = torch.zeros(1)
    out = []
    dist.all_reduce(token)
    wall, cpu, busy = time.perf_counter(), time.process_time(), machine_busy_s()
    for n in reps:
        dist.all_reduce(token)  # start together
        laps, compute = [], []
        for _ in range(rounds):
            start = time.perf_counter()
            _work(n)
            compute.append(time.perf_counter() - start)
            dist.all_reduce(token)
            laps.append(time.perf_counter() - start)
        out.append((statistics.median(laps), statistics.median(compute)))
    after = machine_busy_s()
    return {"sizes": out, "cpu": time.process_time() - cpu, "wall": time.perf_counter() - wall,
            "busy": after - busy if rank == 0 and after is not None and busy is not None
            else None}  # fmt: skip


def loop_other_load(ranks: list[dict]) -> float:
    """Cores' worth of CPU other processes took while :func:`_meet_loop` ran on ``ranks``
    (0 where the machine's busy time is unknown)."""
    busy = ranks[0].get("busy")
    if busy is None or ranks[0]["wall"] <= 0:
        return 0.0
    return max(busy - sum(r["cpu"] for r in ranks), 0.0) / ranks[0]["wall"]


def delay_from_excess(excess_s: float, work_s: float, cores: int) -> float:
    """The ``delay_s`` at which ``cores + 1`` ranks of ``work_s`` lose ``excess_s`` to
    placement (:func:`.cores.placement_wait` inverted by bisection; it grows with the delay
    until a freed core is never taken in time, where the answer is that bound)."""
    if excess_s <= 0:
        return 0.0
    hi = 2 * work_s * (cores + 1)
    if placement_wait(work_s, cores + 1, cores, 1, hi) <= excess_s:
        return hi
    lo = 0.0
    for _ in range(50):
        mid = (lo + hi) / 2
        short = placement_wait(work_s, cores + 1, cores, 1, mid) < excess_s
        lo, hi = (mid, hi) if short else (lo, mid)
    return (lo + hi) / 2


def measure_delay(cores: int, rounds: int = 30, trials: int = 3,
                  timeout: float = 120) -> float | None:  # fmt: skip
    """This machine's delay (seconds) before a waiting thread takes a core that fell idle,
    from :func:`_meet_loop` at ``cores + 1`` and ``cores`` ranks (see the module docstring):
    the median over ``trials`` quiet trials of the median over work sizes (a trial beside
    other load is run again, up to ``trials`` more times; ``None`` without a quiet one). Zero
    on one core, where two ranks always share it evenly."""
    if cores < 2:
        return 0.0
    rate = _units_per_second()
    reps = [max(1, round(w * rate)) for w in WORK_S]
    quiet = []
    for _ in range(2 * trials):
        crowded = run_on_ranks(_meet_loop, cores + 1, reps, rounds, timeout=timeout)
        alone = run_on_ranks(_meet_loop, cores, reps, rounds, timeout=timeout)
        sizes = []
        for i in range(len(reps)):
            work = statistics.mean(r["sizes"][i][1] for r in alone)  # own compute, a core each
            # fair sharing would add work / cores to the round the ranks take alone
            excess = crowded[0]["sizes"][i][0] - alone[0]["sizes"][i][0] - work / cores
            sizes.append(delay_from_excess(excess, work, cores))
        if max(loop_other_load(crowded), loop_other_load(alone)) <= QUIET_LOAD:
            quiet.append(statistics.median(sizes))
        if len(quiet) == trials:
            break
    return statistics.median(quiet) if quiet else None
