"""Ring allreduce: reduce-scatter then all-gather around a ring, pipelined in segments.

Baidu's ring allreduce (Gibiansky, 2017; Patarasuk & Yuan, "Bandwidth optimal all-reduce
algorithms for clusters of workstations", 2009), the "share-reduce then share-only"
phases of the course slides (003, slides 46-49) and the talk (002): every rank sends only
to its right neighbour and receives only from its left one.

The tensor is cut into ``p`` chunks. In reduce-scatter step ``s`` rank ``r`` sends chunk
``(r - s) mod p`` and adds the chunk ``(r - s - 1) mod p`` it receives; after ``p - 1``
steps it holds the complete sum of chunk ``(r + 1) mod p``. All-gather passes these
finished chunks around for another ``p - 1`` steps. Each rank sends about
``2 (p - 1) / p * n`` elements, whatever ``p`` is (see :mod:`.cost_model` for the exact
count with uneven chunks).

The chunk a rank receives at step ``t`` is the one it sends at step ``t + 1``, so large
chunks are cut into segments and each segment is forwarded as soon as it has been
reduced: the link to the right neighbour never waits for a whole chunk.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_par.collectives._common import (
    chunk_sizes,
    finish,
    ordered_exchange,
    prepare,
    scratch,
    segment_elems_for,
    segments,
)
from lightning_par.comm import CommTrace, Communicator, Handle, wait_all
from lightning_par.split import offsets as split_offsets

#: Largest message of the pipeline: a chunk is sent in segments so that adding one segment
#: overlaps with receiving the next, but every message also costs a wake-up of sender and
#: receiver. On the idle 2-core test machine (16M floats, 4 ranks, loopback, medians of 30)
#: 4 MiB segments ran at 0.96-0.98x torch's speed, 2 MiB at 0.91-0.95x, 16 MiB (one message
#: per chunk) 0.88-0.93x; gloo's own C++ ring uses 1 MiB. Tune with
#: ``python -m lightning_par.bench allreduce --segment-bytes ...``.
DEFAULT_SEGMENT_BYTES = 4 << 20


def ring_schedule(rank: int, world_size: int) -> list[tuple[int, int]]:
    """``(chunk sent, chunk received)`` by rank ``rank`` at each of the ``2 (p - 1)`` steps."""
    p = world_size
    reduce_scatter = [((rank - s) % p, (rank - s - 1) % p) for s in range(p - 1)]
    all_gather = [((rank + 1 - s) % p, (rank - s) % p) for s in range(p - 1)]
    return reduce_scatter + all_gather


def ring_allreduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    comm: Communicator | None = None,
    trace: CommTrace | None = None,
    segment_bytes: int | None = DEFAULT_SEGMENT_BYTES,
) -> torch.Tensor:
    """Sum ``tensor`` in place over the ranks of ``group`` with the ring algorithm.

    Args:
        tensor: any shape and floating dtype; CPU or CUDA.
        group: process group (``None``: default group); or pass ``comm``.
        comm: an existing :class:`~lightning_par.comm.Communicator` (carries its trace).
        trace: record every message here (trace ``step`` = ring step, ``chunk`` = chunk).
        segment_bytes: largest message; ``None`` sends each chunk as one message.
    """
    comm, flat = prepare(tensor, group, comm, trace)
    if flat is None:
        return tensor
    p, rank = comm.world_size, comm.rank
    sizes = chunk_sizes(flat.numel(), p)
    offsets = split_offsets(sizes)
    seg = segment_elems_for(segment_bytes, flat.element_size())
    if p == 2:
        return finish(tensor, _two_rank_ring(flat, comm, sizes, offsets, seg))
    right, left = (rank + 1) % p, (rank - 1) % p
    schedule = ring_schedule(rank, p)
    n_steps = len(schedule)
    reduce_steps = p - 1
    # Two receive buffers, alternating by step, so step t + 1's receives can be posted
    # while step t's segments are still being added.
    buffers = scratch((2, max(sizes)), flat.dtype, flat.device)

    def pieces(chunk: int) -> list[tuple[int, int]]:
        return segments(offsets[chunk], sizes[chunk], seg)

    def post_receives(step: int) -> list[tuple[Handle, int, int]]:
        chunk = schedule[step][1]
        posted = []
        for start, stop in pieces(chunk):
            if step < reduce_steps:
                base = offsets[chunk]
                target = buffers[step % 2, start - base : stop - base]
            else:
                target = flat[start:stop]  # all-gather: the finished chunk lands in place
            tag = "reduce-scatter" if step < reduce_steps else "all-gather"
            handle = comm.irecv(target, left, step=step, chunk=chunk, tag=tag)
            posted.append((handle, start, stop))
        return posted

    def send(step: int, start: int, stop: int) -> Handle:
        tag = "reduce-scatter" if step < reduce_steps else "all-gather"
        return comm.isend(flat[start:stop], right, step=step, chunk=schedule[step][0], tag=tag)

    sends: list[list[Handle]] = [[send(0, a, b) for a, b in pieces(schedule[0][0])]]
    receives = post_receives(0)
    for step in range(n_steps):
        nxt = step + 1
        next_receives = []
        if nxt < n_steps:
            if nxt >= reduce_steps:
                # All-gather writes into chunk schedule[nxt][1], which this rank sent at
                # reduce-scatter step nxt - (p - 1): that send must have left the buffer.
                for handle in sends[nxt - reduce_steps]:
                    handle.wait()
            next_receives = post_receives(nxt)
            sends.append([])
        for handle, start, stop in receives:
            handle.wait()
            if step < reduce_steps:
                base = offsets[schedule[step][1]]
                flat[start:stop].add_(buffers[step % 2, start - base : stop - base])
            if nxt < n_steps:  # forward the segment at once (the pipeline)
                sends[nxt].append(send(nxt, start, stop))
        receives = next_receives
    for step_sends in sends:
        for handle in step_sends:
            handle.wait()
    return finish(tensor, flat)


def _two_rank_ring(
    flat: torch.Tensor, comm: Communicator, sizes: list[int], offsets: list[int], seg: int | None
) -> torch.Tensor:
    """The ring for ``p = 2``: the left and right neighbour are one rank, so each step is
    an exchange posted in rank order (NCCL puts both directions on one stream, see
    :func:`~lightning_par.collectives._common.ordered_exchange`)."""
    peer = 1 - comm.rank
    buffer = scratch((max(sizes),), flat.dtype, flat.device)
    for step, (send_chunk, recv_chunk) in enumerate(ring_schedule(comm.rank, 2)):
        tag = "reduce-scatter" if step == 0 else "all-gather"
        send_kw = {"step": step, "chunk": send_chunk, "tag": tag}
        recv_kw = {"step": step, "chunk": recv_chunk, "tag": tag}
        base, size = offsets[recv_chunk], sizes[recv_chunk]
        target = buffer if step == 0 else flat[base : base + size]
        outgoing = segments(offsets[send_chunk], sizes[send_chunk], seg)
        sends = [(flat[a:b], send_kw) for a, b in outgoing]
        recvs = [(target[a - base : b - base], recv_kw) for a, b in segments(base, size, seg)]
        wait_all(ordered_exchange(comm, sends, recvs, peer))
        if step == 0:
            flat[base : base + size].add_(buffer[:size])
    return flat
