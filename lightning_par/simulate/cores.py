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
"""

from __future__ import annotations


def lightning_threads(ranks: int, cores: int) -> int:
    """Intra-op threads per rank that Lightning's launcher picks for ``ranks`` on ``cores``."""
    return max(1, cores // max(1, ranks))


def stretches(
    computes: dict[tuple, tuple[float, float, float]],
    weight: dict[int, int],
    cores: int,
    threads: int = 1,
) -> dict[tuple, float]:
    """Per compute span ``(lane, op) -> (start, end, own seconds)``: how many times its own
    work it takes when every span shares ``cores`` with those it overlaps (time-averaged
    threads at once, its own included, over ``cores``; at least 1)."""
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    items = [(key, a, b, weight.get(key[0][0], 1) * threads) for key, (a, b, _) in
             computes.items() if b > a]  # fmt: skip
    out: dict[tuple, float] = {}
    for key, a, b, _ in items:
        busy = sum(w * (min(b, d) - max(a, c)) for _, c, d, w in items if c < b and d > a)
        out[key] = max(1.0, busy / (b - a) / cores)
    return out
