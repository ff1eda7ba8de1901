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

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "MIN_SPLIT_BYTES",
    "ring_allreduce",
    "ring_schedule",
    "segments_per_chunk",
]


def segments_per_chunk(chunk_elems: int, element_size: int, segment_bytes: int | None) -> int:
    """How many segments ``k`` a ring chunk of ``chunk_elems`` elements is cut into.

    ``segment_bytes=None``: one per chunk (the textbook ring's messages, not overlapped).
    Otherwise enough that none exceeds ``segment_bytes``, and at least two when the chunk
    holds ``2 * MIN_SPLIT_BYTES`` (so one segment is added while the next is in flight).
    """
    seg = segment_elems_for(segment_bytes, element_size)
    if seg is None or chunk_elems <= 1:
        return 1
    k = -(-chunk_elems // seg)
    if chunk_elems * element_size >= 2 * MIN_SPLIT_BYTES:
        k = max(k, 2)
    return min(k, chunk_elems)


def ring_allreduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    comm: Communicator | None = None,
    trace: CommTrace | None = None,
    segment_bytes: int | None = DEFAULT_SEGMENT_BYTES,
) -> torch.Tensor:
    """Sum ``tensor`` in place over the ranks of ``group`` with the pipelined ring.

    Args:
        tensor: any shape and floating dtype; CPU or CUDA.
        group: process group (``None``: default group); or pass ``comm``.
        comm: an existing :class:`~lightning_par.comm.Communicator` (carries its trace).
        trace: record every message here (trace ``step`` = ring step, ``chunk`` = chunk).
        segment_bytes: largest message (see :func:`segments_per_chunk`); ``None`` sends
            each chunk as one message.
    """
    comm, flat = prepare(tensor, group, comm, trace)
    if flat is None:
        return tensor
    p, rank = comm.world_size, comm.rank
    sizes = chunk_sizes(flat.numel(), p)
    starts = split_offsets(sizes)
    k = segments_per_chunk(max(sizes), flat.element_size(), segment_bytes)
    # pieces[c][j]: (start, stop) in ``flat`` of segment j of chunk c (empty when c is small)
    pieces = [[(starts[c] + a, starts[c] + b) for a, b in bounds(even_sizes(sizes[c], k))]
              for c in range(p)]  # fmt: skip
    schedule = ring_schedule(rank, p)
    reduce_iters, total = (p - 1) * k, 2 * (p - 1) * k
    right, left = (rank + 1) % p, (rank - 1) % p
    slot_len = max(b - a for a, b in pieces[0])
    slots = scratch((2, slot_len), flat.dtype, flat.device)
    recvs: list[tuple[Handle, int, int] | None] = [None] * total
    sends: list[Handle | None] = [None] * total

    def complete(i: int) -> None:
        """Finish receive ``i``; in the reduce-scatter add it to the local chunk."""
        posted = recvs[i]
        if posted is None:
            return
        handle, a, b = posted
        handle.wait()
        if i < reduce_iters:
            flat[a:b].add_(slots[i % 2, : b - a])

    def post(i: int) -> None:
        step, j = divmod(i, k)
        send_c, recv_c = schedule[step]
        tag = "reduce-scatter" if i < reduce_iters else "all-gather"
        (sa, sb), (ra, rb) = pieces[send_c][j], pieces[recv_c][j]
        # p = 2: one peer on both sides; NCCL runs its sends and receives in posting
        # order on one stream, so the lower rank sends first (see ordered_exchange).
        send_first = p == 2 and rank == 0
        if send_first and sb > sa:
            sends[i] = comm.isend(flat[sa:sb], right, step=step, chunk=send_c, tag=tag)
        if rb > ra:
            # reduce-scatter: into a slot, added later; all-gather: straight into place
            target = slots[i % 2, : rb - ra] if i < reduce_iters else flat[ra:rb]
            handle = comm.irecv(target, left, step=step, chunk=recv_c, tag=tag)
            recvs[i] = (handle, ra, rb)
        if not send_first and sb > sa:
            sends[i] = comm.isend(flat[sa:sb], right, step=step, chunk=send_c, tag=tag)

    completed = 0
    window = min(k, 2)
    for i in range(total):
        # Segment i's send carries receive i - k (added); its slot held receive i - 2.
        while completed <= i - window:
            complete(completed)
            completed += 1
        if i >= reduce_iters and sends[i - reduce_iters] is not None:
            # the all-gather lands where the reduce-scatter sent from: that send must be out
            sends[i - reduce_iters].wait()
        post(i)
    while completed < total:
        complete(completed)
        completed += 1
    for handle in sends:
        if handle is not None:
            handle.wait()
    return finish(tensor, flat)
