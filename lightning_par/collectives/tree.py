"""Tree allreduce: reduce up a binary tree to the root, then broadcast back down.

The reduction tree of the talk (002): with 7 nodes holding 1..7, the two inner nodes
sum their children (1+2+5 = 8 and 3+4+6 = 13) in the first step and the root adds
8 + 13 + 7 = 28 in the second; the result then travels back down. Both phases take
``depth = floor(log2 p)`` steps, so the message count grows with ``log p``: the
latency-friendly choice for small tensors, while every inner node moves ``3n``
elements (course slides 003, "tree allreduce"; Thakur et al., "Optimization of
collective communication operations in MPICH", 2005).

Ranks form a binary heap relative to the root: virtual rank ``v = (rank - root) mod p``
has children ``2v + 1`` and ``2v + 2``, so any ``p`` works, power of two or not.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_par.collectives._common import (
    depth_in_heap,
    finish,
    prepare,
    scratch,
)
from lightning_par.comm import CommTrace, Communicator, wait_all


def tree_children(virtual_rank: int, world_size: int) -> list[int]:
    return [c for c in (2 * virtual_rank + 1, 2 * virtual_rank + 2) if c < world_size]


def tree_depth(world_size: int) -> int:
    """Number of levels below the root (0 for one rank)."""
    return depth_in_heap(world_size - 1)


def tree_reduce(
    flat: torch.Tensor, comm: Communicator, root: int = 0, *, step_offset: int = 0
) -> None:
    """Sum the 1-D ``flat`` of every rank into the root's ``flat`` (others keep partial sums).

    A node at depth ``d`` sends up at step ``depth - d``: leaves first, the root's children last.
    """
    p = comm.world_size
    v = (comm.rank - root) % p
    depth = tree_depth(p)
    children = tree_children(v, p)
    # One reused buffer per child (see butterfly.py: fresh ones cost page faults).
    buffers = scratch((len(children), flat.numel()), flat.dtype, flat.device)
    handles = [
        comm.irecv(buf, (c + root) % p, step=step_offset + depth - depth_in_heap(c), tag="reduce")
        for c, buf in zip(children, buffers)
    ]
    for handle, buf in zip(handles, buffers):
        handle.wait()
        flat.add_(buf)
    if v != 0:
        parent = ((v - 1) // 2 + root) % p
        comm.send(flat, parent, step=step_offset + depth - depth_in_heap(v), tag="reduce")


def tree_broadcast(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    root: int = 0,
    comm: Communicator | None = None,
    trace: CommTrace | None = None,
    step_offset: int = 0,
) -> torch.Tensor:
    """Copy the root's ``tensor`` to every rank down the binary tree (in place).

    A node at depth ``d`` receives at step ``step_offset + d - 1`` and sends at
    ``step_offset + d``.
    """
    comm, flat = prepare(tensor, group, comm, trace)
    if flat is None:
        return tensor
    p = comm.world_size
    v = (comm.rank - root) % p
    d = depth_in_heap(v)
    if v != 0:
        parent = ((v - 1) // 2 + root) % p
        comm.recv(flat, parent, step=step_offset + d - 1, tag="broadcast")
    wait_all(
        [
            comm.isend(flat, (c + root) % p, step=step_offset + d, tag="broadcast")
            for c in tree_children(v, p)
        ]
    )
    return finish(tensor, flat)


def tree_allreduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    comm: Communicator | None = None,
    trace: CommTrace | None = None,
) -> torch.Tensor:
    """Sum ``tensor`` in place over the ranks of ``group``: reduce to rank 0, broadcast back.

    Trace steps ``0 .. depth - 1`` are the reduction, ``depth .. 2 depth - 1`` the broadcast.
    """
    comm, flat = prepare(tensor, group, comm, trace)
    if flat is None:
        return tensor
    tree_reduce(flat, comm, root=0)
    tree_broadcast(flat, comm=comm, root=0, step_offset=tree_depth(comm.world_size))
    return finish(tensor, flat)
