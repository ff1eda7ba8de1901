"""The alpha-beta cost model: messages, bytes and time of each allreduce (and of the ring's
two phases), per rank.

Sending ``m`` bytes costs ``alpha + beta * m`` (Hockney's model): ``alpha`` is the
latency of one message, ``beta`` the time per byte (1 / bandwidth). Counts are exact:
the tests check that the trace of a real run sends exactly these bytes and messages
(empty messages are never sent). Times are critical-path estimates:

=====================  ===================================  ==========================
algorithm              bytes sent by rank ``r`` (elements)  time
=====================  ===================================  ==========================
ring                   ``2n - c[(r+1)%p] - c[(r+2)%p]``     ``2(p-1)(alpha + c_max b)``
tree                   ``n * (children + (r != 0))``        ``2D(alpha + k n b)``
butterfly (p=2^k)      ``n log2 p``                         ``log2 p (alpha + n b)``
all-to-all             ``(p-1) n``                          ``alpha + (p-1) n b``
master-worker          ``(p-1) n`` at rank 0, ``n`` else    ``2(alpha + (p-1) n b)``
round-robin            ``n - c[r] + (p-1) c[r]``            ``2(p-1)(alpha + c_max b)``
ring reduce-scatter    ``n - c[r]``                         ``(p-1)(alpha + c_max b)``
ring all-gather        ``n - c[(r+1)%p]``                   ``(p-1)(alpha + c_max b)``
=====================  ===================================  ==========================

with ``c[i]`` the ring's chunk sizes (``n // p`` or one more, see
:func:`~lightning_par.collectives._common.chunk_sizes`), ``b = beta * element_size``,
``D = floor(log2 p)`` the tree depth and ``k`` the number of children of a tree node
(2 once ``p > 2``). So the ring sends ``2(p-1)/p * n`` elements per rank when ``p``
divides ``n``; butterfly with ``p`` not a power of two adds a fold-in and a fold-out
step of ``n`` elements for the folded pairs. Round-robin sends the ring's volume in the
ring's number of steps (one port per rank, one message per step), but each message goes
straight to the chunk's owner instead of along the ring. The ring's two phases alone
(:mod:`~lightning_par.collectives.ring_phases`, not allreduces, so not in
:data:`COST_MODELS`: :func:`reduce_scatter_cost`, :func:`all_gather_cost`) each send
half the ring's volume, ``(p-1)/p * n`` elements when ``p`` divides ``n``, one message per
segment of each chunk sent.

Tensor parallelism's ring all-gather and reduce-scatter of unequal slices, and the sum of a
step's collectives, are costed beside its algorithm, in :mod:`lightning_par.tensorparallel.cost`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from lightning_par.collectives._common import chunk_sizes
from lightning_par.collectives.butterfly import butterfly_shape
from lightning_par.collectives.ring import (
    ALL_GATHER,
    DEFAULT_SEGMENT_BYTES,
    MIN_SPLIT_BYTES,
    REDUCE_SCATTER,
    ring_steps,
    segments_per_chunk,
)
from lightning_par.collectives.tree import tree_children, tree_depth
from lightning_par.comm.buckets import make_buckets


@dataclass(frozen=True)
class Cost:
    """Predicted communication of one collective of ``numel`` elements on ``world_size`` ranks."""

    algorithm: str
    world_size: int
    numel: int
    element_size: int
    bytes_sent: tuple[int, ...]  # per rank
    messages_sent: tuple[int, ...]  # per rank
    steps: int  # sequential communication steps on the critical path
    latency_terms: float  # number of alphas on the critical path
    bandwidth_bytes: float  # bytes on the critical path (times beta)

    def time(self, alpha: float, beta: float) -> float:
        """Predicted seconds for latency ``alpha`` (s/message) and ``beta`` (s/byte)."""
        return self.latency_terms * alpha + self.bandwidth_bytes * beta

    @property
    def max_bytes_sent(self) -> int:
        return max(self.bytes_sent)


def zero_cost(algorithm: str, numel: int, p: int, element_size: int) -> Cost:
    """The cost of a collective with nothing to send (one rank, or no elements)."""
    return Cost(algorithm, p, numel, element_size, (0,) * p, (0,) * p, 0, 0.0, 0.0)


def _cost(algorithm: str, p: int, numel: int, element_size: int, bytes_sent: Iterable[int],
          messages: Iterable[int], steps: int, critical_bytes: float) -> Cost:  # fmt: skip
    """A :class:`Cost` whose critical path is ``steps`` steps of one message (one alpha)
    each, carrying ``critical_bytes`` in all: every algorithm here has that shape."""
    return Cost(algorithm, p, numel, element_size, tuple(bytes_sent), tuple(messages), steps,
                float(steps), float(critical_bytes))  # fmt: skip


def ring_cost(numel: int, world_size: int, element_size: int = 4,
              segment_bytes: int | None = DEFAULT_SEGMENT_BYTES,
              min_split_bytes: int = MIN_SPLIT_BYTES) -> Cost:  # fmt: skip
    return _pipelined_ring_cost("ring", (REDUCE_SCATTER, ALL_GATHER), numel, world_size,
                                element_size, segment_bytes, min_split_bytes)  # fmt: skip


def reduce_scatter_cost(numel: int, world_size: int, element_size: int = 4,
                        segment_bytes: int | None = DEFAULT_SEGMENT_BYTES) -> Cost:  # fmt: skip
    """:func:`~lightning_par.collectives.ring_reduce_scatter`: rank ``r`` sends every chunk
    but its own, half the ring allreduce's volume (the sum over ranks is exactly half)."""
    return _pipelined_ring_cost("ring_reduce_scatter", (REDUCE_SCATTER,), numel, world_size,
                                element_size, segment_bytes)  # fmt: skip


def all_gather_cost(numel: int, world_size: int, element_size: int = 4,
                    segment_bytes: int | None = DEFAULT_SEGMENT_BYTES) -> Cost:  # fmt: skip
    """:func:`~lightning_par.collectives.ring_all_gather`: rank ``r`` sends every chunk but
    its right neighbour's (the one chunk that would come back to its owner)."""
    return _pipelined_ring_cost("ring_all_gather", (ALL_GATHER,), numel, world_size,
                                element_size, segment_bytes)  # fmt: skip


def _pipelined_ring_cost(name: str, phases: tuple[str, ...], numel: int, p: int,
                         element_size: int, segment_bytes: int | None,
                         min_split_bytes: int = MIN_SPLIT_BYTES) -> Cost:  # fmt: skip
    """The ring engine's traffic for ``phases``, step by step from :func:`ring_steps`."""
    if p == 1 or numel == 0:
        return zero_cost(name, numel, p, element_size)
    sizes = chunk_sizes(numel, p)
    # each chunk goes in k segments of near-equal size; a chunk of c < k elements in c
    k = segments_per_chunk(max(sizes), element_size, segment_bytes, min_split_bytes)
    elems, messages = [], []
    for rank in range(p):
        sent = [sizes[chunk] for _, chunk, _ in ring_steps(rank, p, phases)]
        elems.append(sum(sent))
        messages.append(sum(min(size, k) for size in sent))
    steps = len(phases) * (p - 1)
    return _cost(name, p, numel, element_size, (e * element_size for e in elems), messages,
                 steps, steps * max(sizes) * element_size)  # fmt: skip


def tree_cost(numel: int, world_size: int, element_size: int = 4) -> Cost:
    p = world_size
    if p == 1 or numel == 0:
        return zero_cost("tree", numel, p, element_size)
    messages = tuple(len(tree_children(r, p)) + (r != 0) for r in range(p))
    depth = tree_depth(p)
    fan_out = max(len(tree_children(r, p)) for r in range(p))
    nbytes = numel * element_size
    return _cost("tree", p, numel, element_size, (m * nbytes for m in messages), messages,
                 2 * depth, 2 * depth * fan_out * nbytes)  # fmt: skip


def butterfly_cost(numel: int, world_size: int, element_size: int = 4) -> Cost:
    p = world_size
    if p == 1 or numel == 0:
        return zero_cost("butterfly", numel, p, element_size)
    q, extra, rounds = butterfly_shape(p)
    messages = tuple(1 if r >= q else rounds + (r < extra) for r in range(p))
    steps = rounds + (2 if extra else 0)
    nbytes = numel * element_size
    return _cost("butterfly", p, numel, element_size, (m * nbytes for m in messages), messages,
                 steps, steps * nbytes)  # fmt: skip


def all_to_all_cost(numel: int, world_size: int, element_size: int = 4) -> Cost:
    p = world_size
    if p == 1 or numel == 0:
        return zero_cost("all_to_all", numel, p, element_size)
    nbytes = numel * element_size
    return _cost("all_to_all", p, numel, element_size, ((p - 1) * nbytes,) * p, (p - 1,) * p,
                 1, (p - 1) * nbytes)  # fmt: skip


def master_worker_cost(numel: int, world_size: int, element_size: int = 4) -> Cost:
    p = world_size
    if p == 1 or numel == 0:
        return zero_cost("master_worker", numel, p, element_size)
    nbytes = numel * element_size
    messages = (p - 1,) + (1,) * (p - 1)
    return _cost("master_worker", p, numel, element_size, (m * nbytes for m in messages),
                 messages, 2, 2 * (p - 1) * nbytes)  # fmt: skip


def round_robin_cost(numel: int, world_size: int, element_size: int = 4) -> Cost:
    p = world_size
    if p == 1 or numel == 0:
        return zero_cost("round_robin", numel, p, element_size)
    sizes = chunk_sizes(numel, p)
    elems, messages = [], []
    for rank in range(p):
        # Every other chunk to its owner, then the own (reduced) chunk to every other rank.
        elems.append(numel - sizes[rank] + (p - 1) * sizes[rank])
        others = sum(1 for j in range(p) if j != rank and sizes[j] > 0)
        messages.append(others + (p - 1 if sizes[rank] > 0 else 0))
    steps = 2 * (p - 1)
    return _cost("round_robin", p, numel, element_size, (e * element_size for e in elems),
                 messages, steps, steps * max(sizes) * element_size)  # fmt: skip


COST_MODELS = {
    "ring": ring_cost,
    "tree": tree_cost,
    "butterfly": butterfly_cost,
    "all_to_all": all_to_all_cost,
    "master_worker": master_worker_cost,
    "round_robin": round_robin_cost,
}


def predict(algorithm: str, numel: int, world_size: int, element_size: int = 4, **options) -> Cost:
    """The :class:`Cost` of ``algorithm`` (a key of :data:`COST_MODELS`)."""
    if algorithm not in COST_MODELS:
        raise ValueError(
            f"unknown allreduce algorithm {algorithm!r}; choose from {list(COST_MODELS)}"
        )
    return COST_MODELS[algorithm](numel, world_size, element_size, **options)


def fit_alpha_beta(nbytes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Least-squares ``alpha, beta`` from one-message timings ``seconds`` of ``nbytes`` bytes."""
    n = len(nbytes)
    if n < 2:
        raise ValueError("need timings of at least two message sizes to fit alpha and beta")
    mean_x, mean_y = sum(nbytes) / n, sum(seconds) / n
    var = sum((x - mean_x) ** 2 for x in nbytes)
    beta = sum((x - mean_x) * (y - mean_y) for x, y in zip(nbytes, seconds)) / var
    alpha = mean_y - beta * mean_x
    return max(alpha, 0.0), max(beta, 0.0)


def crossover(first: str, second: str, world_size: int, alpha: float, beta: float) -> int | None:
    """Smallest power-of-two size (elements) where ``second`` becomes faster than ``first``."""
    for k in range(0, 31):
        n = 1 << k
        if predict(second, n, world_size).time(alpha, beta) < predict(first, n, world_size).time(
            alpha, beta
        ):
            return n
    return None


__all__ = [
    "COST_MODELS",
    "Cost",
    "all_gather_cost",
    "all_to_all_cost",
    "butterfly_cost",
    "crossover",
    "fit_alpha_beta",
    "master_worker_cost",
    "predict",
    "reduce_scatter_cost",
    "ring_cost",
    "round_robin_cost",
    "tree_cost",
]


def bucketed_allreduce_bytes(
    model: nn.Module, algorithm: str, world: int, bucket_cap_mb: float = 4.0
) -> list[int]:
    """Per rank: bytes sent by ``algorithm``'s allreduce of each of ``model``'s gradient
    buckets, packed as :class:`~lightning_par.comm.buckets.GradientBuckets` packs them
    (gradients in reverse order, one flag per parameter), summed over the buckets."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [0] * world
    for bucket in make_buckets(list(reversed(params)), int(bucket_cap_mb * 2**20)):
        cost = predict(algorithm, bucket.buffer.numel(), world, bucket.buffer.element_size())
        total = [t + b for t, b in zip(total, cost.bytes_sent)]
    return total
