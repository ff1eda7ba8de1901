"""Ring allreduce, pipelined: reduce-scatter then all-gather as one stream of segments.

Baidu's ring allreduce (Gibiansky, 2017; Patarasuk & Yuan, "Bandwidth optimal all-reduce
algorithms for clusters of workstations", 2009), the "share-reduce then share-only" phases
of the course slides (003, slides 46-49): every rank sends only to its right neighbour and
receives only from its left one, ``2 (p - 1) / p * n`` elements in all. The step-by-step
version the course draws is :mod:`.ring_textbook`; this one moves the same bytes faster.

In the textbook ring the link and the adder take turns: a chunk arrives, is added, and only
then goes on. Here every chunk is cut into ``k`` segments sized to the message (at most
``segment_bytes``, and at least two once a chunk is worth splitting), and the ``2 (p - 1)``
steps become one stream of ``2 (p - 1) k`` segment iterations, as in gloo's own ring
(``gloo/allreduce.cc``): at iteration ``i`` a rank posts the receive of segment ``i`` and
sends segment ``i``, which is segment ``i - k`` received and added earlier, while segment
``i - 1`` is still in flight. Two receive slots alternate, so the addition of one segment
overlaps the transfer of the next and the link never waits for a whole chunk. Chunk and
step boundaries disappear: the first segments of the all-gather leave while the last ones
of the reduce-scatter are still being added.

The engine, :class:`SegmentRing`, runs a list of steps (:func:`ring_steps`), so it runs
either phase alone as well (:mod:`.ring_phases`: the reduce-scatter and all-gather that
sharded data parallelism needs, Rajbhandari et al., "ZeRO", 2020); :func:`ring_allreduce` is
the two run as one stream.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_par.collectives._common import (
    chunk_sizes,
    finish,
    prepare,
    scratch,
    segment_elems_for,
)
from lightning_par.collectives.ring_textbook import ring_schedule
from lightning_par.comm import CommTrace, Communicator, Handle
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

__all__ = [
    "ALL_GATHER",
    "DEFAULT_SEGMENT_BYTES",
    "MIN_SPLIT_BYTES",
    "RECEIVES_IN_FLIGHT",
    "REDUCE_SCATTER",
    "SegmentRing",
    "ring_allreduce",
    "ring_schedule",
    "ring_steps",
    "run_ring",
    "segments_per_chunk",
]


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


def ring_allreduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    comm: Communicator | None = None,
    trace: CommTrace | None = None,
    segment_bytes: int | None = DEFAULT_SEGMENT_BYTES,
    receives_in_flight: int = RECEIVES_IN_FLIGHT,
    min_split_bytes: int = MIN_SPLIT_BYTES,
) -> torch.Tensor:
    """Sum ``tensor`` in place over the ranks of ``group`` with the pipelined ring: its
    reduce-scatter and all-gather (:func:`ring_steps`) run as one stream of segments.

    Args:
        tensor: any shape and floating dtype; CPU or CUDA.
        group: process group (``None``: default group); or pass ``comm``.
        comm: an existing :class:`~lightning_par.comm.Communicator` (carries its trace).
        trace: record every message here (trace ``step`` = ring step, ``chunk`` = chunk).
        segment_bytes: largest message (see :func:`segments_per_chunk`); ``None`` sends
            each chunk as one message.
        receives_in_flight: receives posted ahead (each with its own buffer); at least 2.
        min_split_bytes: a chunk of fewer than twice this many bytes goes in one message.

    The three last are the machine's to choose: :mod:`.ring_tuning` picks them (by the
    cores each rank has, or timed at start-up) for the strategies and ``bench allreduce``.
    """
    both = (REDUCE_SCATTER, ALL_GATHER)
    run_ring(tensor, both, group, comm, trace, segment_bytes, receives_in_flight, "allreduce",
             min_split_bytes=min_split_bytes)  # fmt: skip
    return tensor


def run_ring(
    tensor: torch.Tensor,
    phases: tuple[str, ...],
    group: dist.ProcessGroup | None,
    comm: Communicator | None,
    trace: CommTrace | None,
    segment_bytes: int | None,
    receives_in_flight: int,
    collective: str,
    min_split_bytes: int = MIN_SPLIT_BYTES,
) -> tuple[Communicator, torch.Tensor | None]:
    """Run ``phases`` of the pipelined ring on ``tensor`` in place (``collective`` names the
    caller in errors). Returns the communicator and the flat view the ring worked on: a
    view of ``tensor``, or, when ``tensor`` is not contiguous, the copy written back to it;
    ``None`` when there was nothing to exchange (one rank, or no elements)."""
    if receives_in_flight < 2:
        raise ValueError(f"receives_in_flight must be >= 2, got {receives_in_flight}")
    comm, flat = prepare(tensor, group, comm, trace, collective)
    if flat is None:
        return comm, None
    steps = ring_steps(comm.rank, comm.world_size, phases)
    SegmentRing(comm, flat, steps, segment_bytes, receives_in_flight, min_split_bytes).run()
    finish(tensor, flat)
    return comm, flat


class SegmentRing:
    """One pipelined run of the ring ``steps`` over ``flat`` on ``comm``: each chunk's
    segments, the receive slots and the stream of ``len(steps) k`` iterations (the module
    docstring)."""

    def __init__(self, comm: Communicator, flat: torch.Tensor, steps: list[RingStep],
                 segment_bytes: int | None, receives_in_flight: int,
                 min_split_bytes: int = MIN_SPLIT_BYTES) -> None:  # fmt: skip
        p = comm.world_size
        self.comm, self.flat = comm, flat
        sizes = chunk_sizes(flat.numel(), p)
        starts = split_offsets(sizes)
        self.k = k = segments_per_chunk(max(sizes), flat.element_size(), segment_bytes,
                                        min_split_bytes)  # fmt: skip
        # pieces[c][j]: (start, stop) in ``flat`` of segment j of chunk c (empty when c is small)
        self.pieces = [[(starts[c] + a, starts[c] + b) for a, b in bounds(even_sizes(sizes[c], k))]
                       for c in range(p)]  # fmt: skip
        self.steps, self.total = steps, len(steps) * k
        self.reduces = [phase == REDUCE_SCATTER for phase, _, _ in steps]
        self.right, self.left = (comm.rank + 1) % p, (comm.rank - 1) % p
        # p = 2 on NCCL: one peer on both sides, whose messages NCCL runs on one stream in
        # posting order, so both ranks post (send i, receive i) pairs, the lower rank's send
        # first (see ordered_exchange). Elsewhere receives are posted as far ahead as buffers
        # allow, so a sender is never held up by a receiver that has not asked yet.
        self.paired = p == 2 and comm.backend == "nccl"
        self.depth = 2 if self.paired else min(receives_in_flight, self.total)
        # one 1-D view per slot, made once: indexing a 2-D tensor per message costs ~30 us;
        # only the reduce-scatter needs them (the all-gather receives into place)
        slot_len = max(b - a for a, b in self.pieces[0]) if any(self.reduces) else 0
        self.slots = scratch((self.depth, slot_len), flat.dtype, flat.device).unbind(0)
        self.recvs: list[tuple[Handle, torch.Tensor, torch.Tensor] | None] = [None] * self.total
        self.sends: list[Handle] = []

    def post_recv(self, i: int) -> None:
        step, j = divmod(i, self.k)
        phase, _, chunk = self.steps[step]
        a, b = self.pieces[chunk][j]
        if b > a:
            # reduce-scatter: into a slot, added later; all-gather: straight into place (no
            # send reads it before: a rank forwards what it received, and its fused
            # reduce-scatter send from there was received before the finished chunk can be)
            own = self.flat[a:b]
            target = self.slots[i % self.depth][: b - a] if self.reduces[step] else own
            handle = self.comm.irecv(target, self.left, step=step, chunk=chunk, tag=phase)
            self.recvs[i] = (handle, own, target)

    def complete(self, i: int) -> None:
        """Wait for receive ``i``; in the reduce-scatter add it to this rank's chunk."""
        received = self.recvs[i]
        if received is not None:
            handle, own, incoming = received
            handle.wait()
            if self.reduces[i // self.k]:
                own.add_(incoming)

    def send(self, i: int) -> None:
        step, j = divmod(i, self.k)
        phase, chunk, _ = self.steps[step]
        a, b = self.pieces[chunk][j]
        if b > a:
            self.sends.append(self.comm.isend(self.flat[a:b], self.right, step=step, chunk=chunk,
                                              tag=phase))  # fmt: skip

    def run(self) -> None:
        # Send i carries receive i - k, added. Waiting one receive later than that (lag 2)
        # lets the next segment arrive while this one is added and sent on.
        lag, rank, total = min(self.k, 2), self.comm.rank, self.total
        completed = posted = 0
        for i in range(total):
            while completed <= i - lag:
                self.complete(completed)
                completed += 1
            if self.paired:
                if rank == 0:
                    self.send(i)
                self.post_recv(i)
                if rank == 1:
                    self.send(i)
                continue
            while posted < min(completed + self.depth, total):  # a free buffer for each
                self.post_recv(posted)
                posted += 1
            self.send(i)
        for i in range(completed, total):
            self.complete(i)
        for handle in self.sends:
            handle.wait()
