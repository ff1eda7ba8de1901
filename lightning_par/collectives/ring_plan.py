"""The ring's plan: what one rank sends and receives at each segment iteration, as numbers.

:func:`plan` turns a ring's shape (rank, ranks, elements, message sizes, phases) into
:class:`RingPlan`: for each of the ``len(steps) k`` iterations of :class:`~.ring.SegmentRing`,
the range of the flat tensor sent and the one received, and whether it is added. It is
the same for every call of the same shape, as a training run's buckets are, so it is worked
out once (cached) and a call only slices its tensor: on a slow core the Python of one call
of the 2-rank ring (chunks, segments, steps, ranges) cost ~100 us, a third of a small
message's whole round.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from lightning_par.collectives._common import chunk_sizes, segment_elems_for
from lightning_par.collectives.ring_textbook import ring_schedule
from lightning_par.split import bounds, even_sizes
from lightning_par.split import offsets as split_offsets

#: Largest segment. Every message also costs a wake-up of sender and receiver (on the
#: 2-core test machine a message pair costs 80-300 us of CPU beyond its bytes), so a chunk
#: is cut into as few segments as keep it under this size; gloo caps its own at 1 MiB,
#: which measured 0.57-0.87x gloo's speed here against 0.63-1.16x for 4 MiB
#: (``benchmarks/allreduce.md``). Tune with ``bench allreduce --segment-bytes``.
DEFAULT_SEGMENT_BYTES = 4 << 20

#: A chunk smaller than two of these goes in one message. Splitting a 1 MiB chunk in two
#: (1M floats on 4 ranks) measured 0.69x gloo against 0.84x unsplit: the second message's
#: fixed cost outweighs the addition it overlaps (about 30 us per 256K floats).
MIN_SPLIT_BYTES = 1 << 20

#: Receives posted ahead. Two (as gloo) suffice when the receiving thread always runs;
#: with more processes than cores it often waits for a core, and a sender whose next
#: receive has not been posted yet waits with it.
RECEIVES_IN_FLIGHT = 8

#: The two phases, also the trace tags of their messages.
REDUCE_SCATTER, ALL_GATHER = "reduce-scatter", "all-gather"

#: One step of one rank: (phase, chunk sent to the right, chunk received from the left).
RingStep = tuple[str, int, int]


class Message(NamedTuple):
    """One iteration's message: ``flat[start:stop]``; empty (``start == stop``) is none."""

    start: int
    stop: int
    step: int
    chunk: int
    phase: str

    def __str__(self) -> str:  # how errors name it
        return f"{self.phase} message, step {self.step}, chunk {self.chunk}"


class RingPlan(NamedTuple):
    """Everything :class:`~.ring.SegmentRing` needs besides the tensor (module docstring)."""

    k: int  #: segments per chunk
    sends: tuple[Message, ...]  #: what iteration ``i`` sends to the right
    recvs: tuple[Message, ...]  #: what iteration ``i`` receives from the left
    reduces: tuple[bool, ...]  #: whether receive ``i`` is added (reduce-scatter)
    slot_len: int  #: elements of a receive slot (0: nothing is added)


def segments_per_chunk(chunk_elems: int, element_size: int, segment_bytes: int | None,
                       min_split_bytes: int = MIN_SPLIT_BYTES) -> int:  # fmt: skip
    """How many segments ``k`` a ring chunk of ``chunk_elems`` elements is cut into.

    ``segment_bytes=None``: one per chunk (the textbook ring's messages, not overlapped).
    Otherwise enough that none exceeds ``segment_bytes``, and at least two when the chunk
    holds ``2 * min_split_bytes`` (so one segment is added while the next is in flight).
    """
    seg = segment_elems_for(segment_bytes, element_size)
    if seg is None or chunk_elems <= 1:
        return 1
    k = -(-chunk_elems // seg)
    if chunk_elems * element_size >= 2 * min_split_bytes:
        k = max(k, 2)
    return min(k, chunk_elems)


def ring_steps(rank: int, world_size: int, phases: tuple[str, ...]) -> list[RingStep]:
    """The steps of ``rank`` in ``phases``: both (the allreduce) or one alone.

    Fused, the reduce-scatter leaves rank ``r`` with the sum of chunk ``(r + 1) % p``, from
    which the all-gather starts: :func:`ring_schedule` of ``r``. Alone, a phase takes the
    schedule of ``r - 1``: the same neighbours, each chunk's sum ending one rank further
    round the ring, so that rank ``r`` owns chunk ``r``, as torch's ``reduce_scatter_tensor`` and
    ``all_gather_into_tensor`` have it. (The fused ring keeps its own: which rank starts a
    chunk's sum decides the bits of the result.)
    """
    if phases not in ((REDUCE_SCATTER, ALL_GATHER), (REDUCE_SCATTER,), (ALL_GATHER,)):
        raise ValueError(f"ring phases must be reduce-scatter, all-gather or both, got {phases}")
    p = world_size
    schedule = ring_schedule(rank if len(phases) == 2 else rank - 1, p)
    halves = {REDUCE_SCATTER: schedule[: p - 1], ALL_GATHER: schedule[p - 1 :]}
    return [(phase, sent, received) for phase in phases for sent, received in halves[phase]]


@functools.lru_cache(maxsize=256)
def plan(rank: int, world_size: int, numel: int, element_size: int, segment_bytes: int | None,
         min_split_bytes: int, phases: tuple[str, ...]) -> RingPlan:  # fmt: skip
    """The :class:`RingPlan` of ``rank`` for a flat tensor of ``numel`` elements."""
    steps = ring_steps(rank, world_size, phases)
    sizes = chunk_sizes(numel, world_size)
    starts = split_offsets(sizes)
    k = segments_per_chunk(max(sizes), element_size, segment_bytes, min_split_bytes)
    # pieces[c][j]: (start, stop) of segment j of chunk c (empty when c is small)
    pieces = [[(starts[c] + a, starts[c] + b) for a, b in bounds(even_sizes(sizes[c], k))]
              for c in range(world_size)]  # fmt: skip
    sends, recvs = [], []
    for step, (phase, sent, received) in enumerate(steps):
        for j in range(k):
            sends.append(Message(*pieces[sent][j], step, sent, phase))
            recvs.append(Message(*pieces[received][j], step, received, phase))
    reduces = tuple(m.phase == REDUCE_SCATTER for m in recvs)
    slot_len = max(b - a for a, b in pieces[0]) if any(reduces) else 0
    return RingPlan(k, tuple(sends), tuple(recvs), reduces, slot_len)
