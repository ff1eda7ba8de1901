"""The textbook ring allreduce: one message per chunk per step, nothing overlapped.

The version the course draws and the exercise asks for (slides 003, pp. 46-49; Patarasuk &
Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", 2009). The
tensor is cut into ``p`` chunks; in reduce-scatter step ``s`` rank ``r`` sends chunk
``(r - s) mod p`` to its right neighbour and adds the chunk ``(r - s - 1) mod p`` that
arrives from its left one; after ``p - 1`` steps it holds the full sum of chunk
``(r + 1) mod p``, and the all-gather passes the finished chunks around for ``p - 1`` more
steps. Every rank sends ``2 (p - 1) / p * n`` elements.

Each step waits for its whole chunk before the addition starts, and the next send waits for
the addition: link and adder take turns. :func:`lightning_par.collectives.ring_allreduce`
moves the same bytes with the two overlapped (segments of a chunk in flight while the last
one is added).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_par.collectives._common import chunk_sizes, finish, ordered_exchange, prepare
from lightning_par.comm import CommTrace, Communicator, wait_all
from lightning_par.split import offsets as split_offsets


def ring_schedule(rank: int, world_size: int) -> list[tuple[int, int]]:
    """``(chunk sent, chunk received)`` by rank ``rank`` at each of the ``2 (p - 1)`` steps."""
    p = world_size
    reduce_scatter = [((rank - s) % p, (rank - s - 1) % p) for s in range(p - 1)]
    all_gather = [((rank + 1 - s) % p, (rank - s) % p) for s in range(p - 1)]
    return reduce_scatter + all_gather


def textbook_ring_allreduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    comm: Communicator | None = None,
    trace: CommTrace | None = None,
) -> torch.Tensor:
    """Sum ``tensor`` in place over ``group`` with the step-by-step ring (see the module).

    Sends exactly the bytes and messages of ``predict("ring", n, p, segment_bytes=None)``.
    """
    comm, flat = prepare(tensor, group, comm, trace)
    if flat is None:
        return tensor
    p, rank = comm.world_size, comm.rank
    sizes = chunk_sizes(flat.numel(), p)
    starts = split_offsets(sizes)
    chunk = [flat[starts[c] : starts[c] + sizes[c]] for c in range(p)]
    right, left = (rank + 1) % p, (rank - 1) % p
    incoming = torch.empty(max(sizes), dtype=flat.dtype, device=flat.device)
    for step, (send_c, recv_c) in enumerate(ring_schedule(rank, p)):
        reducing = step < p - 1
        tag = "reduce-scatter" if reducing else "all-gather"
        target = incoming[: sizes[recv_c]] if reducing else chunk[recv_c]
        # empty chunks (fewer elements than ranks) are not sent
        sends = (
            [(chunk[send_c], {"step": step, "chunk": send_c, "tag": tag})] if sizes[send_c] else []
        )
        recvs = [(target, {"step": step, "chunk": recv_c, "tag": tag})] if sizes[recv_c] else []
        if p == 2:  # one peer on both sides: post in rank order (see ordered_exchange)
            wait_all(ordered_exchange(comm, sends, recvs, right))
        else:
            wait_all([comm.irecv(t, left, **kw) for t, kw in recvs]
                     + [comm.isend(t, right, **kw) for t, kw in sends])  # fmt: skip
        if reducing:
            chunk[recv_c].add_(target)
    return finish(tensor, flat)
