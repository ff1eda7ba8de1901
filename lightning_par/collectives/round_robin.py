"""Round-robin allreduce: every rank in turn is the reducer of one chunk.

The course slides (003, "AllReduce Implementation") list round-robin allreduce between
tree and butterfly, citing Zhao & Canny, "Butterfly Mixing: Accelerating
Incremental-Update Algorithms on Clusters" (SDM 2013, arXiv:1312.3020), whose abstract
compares butterfly mixing with a full mix (AllReduce) on every step; the slide gives no
further description, and we could not consult the paper's full text. We read "round-robin"
as the parameter-server-like scheme in which the model is partitioned and each node in turn
is responsible for aggregating one partition, so the aggregation work and traffic are spread
over all nodes instead of funnelled through one master.

We implement that reading because it is the one that differs from the other five
collectives: **master-worker allreduce with the master's job dealt out round-robin over
chunks** (a rank that sends its whole array to every other rank in turn would be all-to-all
allreduce with a schedule). The tensor is cut into ``p`` chunks (``chunk_sizes``); rank
``r`` owns chunk ``r``.

1. *Reduce* (steps ``0 .. p-2``): in step ``s`` rank ``r`` sends chunk ``(r + s + 1) mod p`` to
   its owner and receives its own chunk from rank ``(r - s - 1) mod p``, then adds the
   ``p - 1`` copies it received. Every step is a shift of all ranks by the same distance, a
   permutation, so no rank receives two messages in one step.
2. *Broadcast* (steps ``p-1 .. 2p-3``): in step ``p - 1 + s`` rank ``r`` sends its finished chunk
   to ``(r + s + 1) mod p`` and receives chunk ``(r - s - 1) mod p`` from its owner.

Each rank sends ``n - c_r + (p - 1) c_r`` elements (``c_r`` its chunk), about ``2 (p-1)/p n``:
the ring's volume, in the same ``2 (p - 1)`` steps. The difference from the ring is the
pattern, not the count: every message goes straight to its destination (no forwarding, so
no chain of dependent steps), but every rank talks to every other rank, which needs a
network where all pairs are connected (the ring only needs neighbours). Only the owner adds
a chunk, so every rank ends with the owner's bits.
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
)
from lightning_par.comm import CommTrace, Communicator, Handle, wait_all
from lightning_par.split import offsets as split_offsets


def round_robin_schedule(rank: int, world_size: int) -> list[tuple[int, int, int, int]]:
    """``(send to, chunk sent, receive from, chunk received)`` by ``rank`` at each step."""
    p = world_size
    reduce = [((rank + d) % p, (rank + d) % p, (rank - d) % p, rank) for d in range(1, p)]
    broadcast = [((rank + d) % p, rank, (rank - d) % p, (rank - d) % p) for d in range(1, p)]
    return reduce + broadcast


def _post_step(
    comm: Communicator,
    step: int,
    tag: str,
    send: tuple[int, int, torch.Tensor],
    recv: tuple[int, int, torch.Tensor],
) -> list[Handle]:
    """Post one step's send and receive; empty chunks are not sent."""
    (dst, send_chunk, out), (src, recv_chunk, into) = send, recv
    sends = [(out, {"step": step, "chunk": send_chunk, "tag": tag})] if out.numel() else []
    recvs = [(into, {"step": step, "chunk": recv_chunk, "tag": tag})] if into.numel() else []
    if dst == src:  # p even, half-way shift: one exchange with one peer, posted in rank order
        return ordered_exchange(comm, sends, recvs, dst)
    handles = [comm.irecv(t, src, **kw) for t, kw in recvs]
    return handles + [comm.isend(t, dst, **kw) for t, kw in sends]


def round_robin_allreduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    comm: Communicator | None = None,
    trace: CommTrace | None = None,
) -> torch.Tensor:
    """Sum ``tensor`` in place over the ranks of ``group``; rank ``r`` reduces chunk ``r``.

    Args:
        tensor: any shape and floating dtype; CPU or CUDA.
        group: process group (``None``: default group); or pass ``comm``.
        comm: an existing :class:`~lightning_par.comm.Communicator` (carries its trace).
        trace: record every message here (trace ``step`` as in the module docstring,
            ``chunk`` = chunk carried, tags ``"reduce"`` and ``"broadcast"``).
    """
    comm, flat = prepare(tensor, group, comm, trace)
    if flat is None:
        return tensor
    p, rank = comm.world_size, comm.rank
    sizes = chunk_sizes(flat.numel(), p)
    offsets = split_offsets(sizes)

    def chunk(i: int) -> torch.Tensor:
        return flat[offsets[i] : offsets[i] + sizes[i]]

    schedule = round_robin_schedule(rank, p)
    # Reduce: all p - 1 steps are posted at once (each step pairs different ranks), the
    # copies of this rank's chunk land in separate rows and are added in step order.
    incoming = scratch((p - 1, sizes[rank]), flat.dtype, flat.device)
    handles = []
    for s, (dst, sent, src, _) in enumerate(schedule[: p - 1]):
        handles += _post_step(comm, s, "reduce", (dst, sent, chunk(sent)), (src, rank, incoming[s]))
    wait_all(handles)  # also frees the other chunks, which the broadcast overwrites
    mine = chunk(rank)
    for s in range(p - 1):
        mine.add_(incoming[s])
    handles = []
    for s, (dst, _, src, got) in enumerate(schedule[p - 1 :]):
        step = p - 1 + s
        handles += _post_step(comm, step, "broadcast", (dst, rank, mine), (src, got, chunk(got)))
    wait_all(handles)
    return finish(tensor, flat)
