"""The ring's message sizes, chosen for the machine: by the cores each rank has, or timed.

A ring message costs its bytes and a fixed part: posting it, a wake-up of the receiving
thread, the bookkeeping on both sides. How many messages a chunk is worth cutting into
(:func:`~.ring_plan.segments_per_chunk`) depends on that fixed part, and it differs from one
machine to the next:

* **more ranks than cores** (4 ranks on the 2-core test machine): a rank often waits for a
  core, a segment in flight hides the next one's wait, and receives posted well ahead keep
  a sender from waiting for a receiver that has not run yet. The ring's constants
  (:data:`SHARED_CORES`: 4 MiB segments, chunks of 2 MiB and more split, 8 receives ahead)
  were measured there (``benchmarks/allreduce.md``);
* **a core per rank**: every extra message is pure cost, and the fewest largest messages
  win. With 2 ranks on 2 cores, 1M-16M floats, ``bench allreduce`` (300/150/50 repetitions
  interleaved, 2026-11-29): 1M floats 0.90x gloo with :data:`SHARED_CORES`, 0.96x in one
  message per chunk; 16M 1.00x against 1.13x with 16 MiB segments; 2 receives ahead as
  good as 8 or better (:data:`CORE_PER_RANK`).

:func:`choose` applies that rule, or, with ``calibrate_now=True`` (the strategy's
``AllReduceStrategy("ring", calibrate_ring=True)``, ``bench allreduce --calibrate``), times
each of :data:`CANDIDATES` on the group itself (interleaved rounds, the slowest rank's time,
the median of the rounds) and keeps the fastest over the sizes timed. Every rank uses rank 0's
choice (broadcast), and rank 0 keeps a calibration in the user's cache folder
(:func:`cache_file`), keyed by the machine, so that later runs on it read it instead of
timing again.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_par.collectives.ring import (
    DEFAULT_SEGMENT_BYTES,
    MIN_SPLIT_BYTES,
    RECEIVES_IN_FLIGHT,
    ring_allreduce,
)


@dataclass(frozen=True)
class RingTuning:
    """The ring's three choices (:func:`~.ring.ring_allreduce`'s arguments of those names)."""

    name: str
    segment_bytes: int | None
    min_split_bytes: int
    receives_in_flight: int

    def options(self) -> dict[str, int | None]:
        """Keyword arguments for :func:`~.ring.ring_allreduce`."""
        return {"segment_bytes": self.segment_bytes, "min_split_bytes": self.min_split_bytes,
                "receives_in_flight": self.receives_in_flight}  # fmt: skip

    def describe(self) -> str:
        seg = "whole chunks" if self.segment_bytes is None else f"{self.segment_bytes >> 10} KiB"
        split = f"{2 * self.min_split_bytes >> 10} KiB"
        return (f"{self.name} (segments {seg}, chunks split from {split}, "
                f"{self.receives_in_flight} receives ahead)")  # fmt: skip


MIB = 1 << 20
SHARED_CORES = RingTuning(
    "shared cores", DEFAULT_SEGMENT_BYTES, MIN_SPLIT_BYTES, RECEIVES_IN_FLIGHT
)
CORE_PER_RANK = RingTuning("a core per rank", 16 * MIB, 4 * MIB, 2)
#: What a calibration times: the two above, gloo's own sizes, and one in between.
CANDIDATES = (
    SHARED_CORES,
    CORE_PER_RANK,
    RingTuning("gloo's sizes", MIB, MIB // 2, 2),
    RingTuning("medium", 4 * MIB, 4 * MIB, 2),
)
#: Floats per calibration size: the strategies' 4 MiB bucket, 4x and 16x that. Not smaller:
#: at 256K floats one calibration's medians differed 3x between candidates that were equal
#: at 1M, and the sum of ratios then picked 1 MiB segments, 0.85x gloo at 4M-16M floats.
CALIBRATION_SIZES = (1 << 20, 1 << 22, 1 << 24)

_ENV_CACHE = "LIGHTNING_PAR_CACHE"


def usable_cores() -> int:
    """Cores this process may run on (its affinity, as a batch scheduler restricts it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def rule(ranks_on_host: int, cores: int | None = None) -> RingTuning:
    """The tuning measured for this many ranks on a host of ``cores`` cores (module doc)."""
    cores = usable_cores() if cores is None else cores
    return CORE_PER_RANK if ranks_on_host <= cores else SHARED_CORES


def machine_key(world_size: int, ranks_on_host: int, backend: str) -> str:
    """What a calibration holds for: this host, its cores, the ranks, the backend, torch."""
    return (f"{socket.gethostname()}|cores={usable_cores()}|p={world_size}|"
            f"local={ranks_on_host}|{backend}|torch={torch.__version__}")  # fmt: skip


def cache_file() -> Path:
    """``$LIGHTNING_PAR_CACHE``, else ``$XDG_CACHE_HOME/lightning_par``, else
    ``~/.cache/lightning_par``; the file ``ring_tuning.json`` there."""
    folder = os.environ.get(_ENV_CACHE)
    if not folder:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
        folder = os.path.join(base, "lightning_par")
    return Path(folder) / "ring_tuning.json"


def cached(key: str) -> RingTuning | None:
    """The tuning a calibration kept for ``key``; ``None`` if none (or the file is unreadable)."""
    try:
        entry = json.loads(cache_file().read_text())[key]
        return RingTuning(entry["name"], entry["segment_bytes"], entry["min_split_bytes"],
                          entry["receives_in_flight"])  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError):
        return None


def keep(key: str, tuning: RingTuning, medians_ms: dict[str, list[float]]) -> None:
    """Write ``tuning`` (and what it was chosen from) for ``key`` into the cache file."""
    path = cache_file()
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        entries = {}
    entries[key] = {**asdict(tuning), "sizes": list(CALIBRATION_SIZES), "medians_ms": medians_ms,
                    "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(entries, indent=1))
    os.replace(partial, path)  # whole or not at all, should two jobs write at once


def calibrate(group: dist.ProcessGroup | None = None, rounds: int = 5,
              sizes: tuple[int, ...] = CALIBRATION_SIZES) -> dict[str, list[float]]:  # fmt: skip
    """Median milliseconds of each of :data:`CANDIDATES` (name -> one per size in ``sizes``),
    the same on every rank: each round runs every candidate once per size after a barrier
    (interleaved, so that load hits them alike), and a round's time is the slowest rank's."""
    times = torch.zeros(len(CANDIDATES), len(sizes), rounds, dtype=torch.float64)
    buffers = [torch.ones(n) for n in sizes]
    for tuning in CANDIDATES:  # a first run of each: buffers, connections
        ring_allreduce(buffers[0], group, **tuning.options())
    for r in range(rounds):
        for s, tensor in enumerate(buffers):
            for c, tuning in enumerate(CANDIDATES):
                dist.barrier(group)
                start = time.perf_counter()
                ring_allreduce(tensor, group, **tuning.options())
                times[c, s, r] = time.perf_counter() - start
            tensor.fill_(1.0)  # sums of sums would overflow to inf, which adds at another speed
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return {tuning.name: [statistics.median(times[c, s].tolist()) * 1e3 for s in range(len(sizes))]
            for c, tuning in enumerate(CANDIDATES)}  # fmt: skip


def fastest(medians_ms: dict[str, list[float]]) -> RingTuning:
    """The candidate whose times, each over the best at its size, sum least."""
    sizes = range(len(next(iter(medians_ms.values()))))
    best = [min(ms[s] for ms in medians_ms.values()) for s in sizes]
    score = {name: sum(ms[s] / best[s] for s in sizes) for name, ms in medians_ms.items()}
    return next(t for t in CANDIDATES if t.name == min(score, key=score.__getitem__))


@dataclass(frozen=True)
class Choice:
    """The tuning a group runs with, and why (``source``, as rank 0 decided it;
    ``medians_ms``: the calibration's times when it was timed now)."""

    tuning: RingTuning
    source: str
    medians_ms: dict[str, list[float]] | None = None


def choose(group: dist.ProcessGroup | None, ranks_on_host: int, *,
           calibrate_now: bool = False) -> Choice:  # fmt: skip
    """The ring's tuning on ``group`` (gloo; on NCCL the ring's constants, untimed). Rank 0
    decides: ``calibrate_now`` times :data:`CANDIDATES` (every rank takes part) and keeps
    the result; otherwise a kept calibration for this machine, else :func:`rule`. Every
    rank gets rank 0's choice."""
    backend = str(dist.get_backend(group)).lower()
    if backend != "gloo":
        return Choice(SHARED_CORES, f"the ring's constants on {backend}")
    key = machine_key(dist.get_world_size(group), ranks_on_host, backend)
    medians = None
    if calibrate_now:
        medians = calibrate(group)
        tuning, source = fastest(medians), "calibrated now"
        if dist.get_rank(group) == 0:
            keep(key, tuning, medians)
    elif (kept := cached(key)) is not None:
        tuning, source = kept, f"calibrated before ({cache_file()})"
    else:
        tuning = rule(ranks_on_host)
        source = f"{ranks_on_host} ranks on {usable_cores()} cores"
    index = torch.tensor([index_of(tuning)])
    root = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(index, src=root, group=group)
    return Choice(CANDIDATES[int(index)], source, medians)


def index_of(tuning: RingTuning) -> int:
    """Where ``tuning``'s choices are in :data:`CANDIDATES` (a cache written by another
    version may name none of them: then :data:`SHARED_CORES`)."""
    same = [i for i, t in enumerate(CANDIDATES) if t.options() == tuning.options()]
    return same[0] if same else 0
