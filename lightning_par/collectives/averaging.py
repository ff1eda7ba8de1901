"""Model averaging: make every rank's parameters the mean of all ranks' (no Lightning needed).

The building block of local SGD and of the course's "ParallelSGD" (000: run SGD on each
worker and average the weights; Zinkevich et al., "Parallelized Stochastic Gradient
Descent", NeurIPS 2010): after some local steps, each floating parameter and buffer is
summed across the ranks with one of our allreduce collectives and divided by the number
of ranks.

All tensors of one dtype and device travel as one flat tensor, so an averaging is one
allreduce per dtype (a few large messages), not one per layer. Integer buffers (e.g.
BatchNorm's ``num_batches_tracked``) are counters, not weights: they are left alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_par.collectives.ring import ring_allreduce
from lightning_par.collectives.tree import tree_broadcast
from lightning_par.comm import Communicator


def averaged_tensors(module: nn.Module, buffers: bool = True) -> list[torch.Tensor]:
    """The tensors :func:`average_parameters` averages: every parameter, and every floating
    buffer when ``buffers`` (shared tensors once)."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    candidates: Iterable[torch.Tensor] = module.parameters()
    if buffers:
        candidates = [*candidates, *module.buffers()]
    for t in candidates:
        if t.is_floating_point() and id(t) not in seen:
            seen.add(id(t))
            found.append(t)
    return found


@torch.no_grad()
def average_parameters(
    module: nn.Module,
    allreduce: Callable[..., torch.Tensor] = ring_allreduce,
    comm: Communicator | None = None,
    *,
    buffers: bool = True,
) -> int:
    """Replace ``module``'s parameters (and floating buffers) by their mean over the ranks.

    Every rank of ``comm``'s group must call this with a module of the same structure.

    Args:
        module: the local replica; changed in place.
        allreduce: a collective of :data:`lightning_par.collectives.ALGORITHMS` (in-place sum).
        comm: the communicator to use (default: a new one on the default group).
        buffers: also average floating buffers (BatchNorm running statistics).

    Returns:
        How many elements were averaged (0 on a single rank: nothing to do).
    """
    comm = comm if comm is not None else Communicator()
    tensors = averaged_tensors(module, buffers)
    if comm.world_size == 1 or not tensors:
        return 0
    for t, mean in zip(tensors, replica_mean([tensors], comm.world_size, allreduce, comm)):
        t.copy_(mean)
    return sum(t.numel() for t in tensors)


@torch.no_grad()
def replica_mean(
    replicas: Sequence[Sequence[torch.Tensor]],
    total: int,
    allreduce: Callable[..., torch.Tensor] = ring_allreduce,
    comm: Communicator | None = None,
) -> list[torch.Tensor]:
    """The mean of each tensor over every replica of the job, as new tensors (the replicas
    are left unchanged): the ``replicas`` this rank trains (lists of tensors of one
    structure) summed here, those sums summed over ``comm``'s ranks, divided by ``total``,
    the replicas of the whole job. One rank training one replica each: :func:`average_parameters`.
    """
    comm = comm if comm is not None else Communicator()
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(replicas[0]):
        groups.setdefault((t.dtype, t.device), []).append(i)
    means: list[torch.Tensor] = [torch.empty(0)] * len(replicas[0])
    for positions in groups.values():
        flat = torch.cat([replicas[0][i].detach().reshape(-1) for i in positions])
        for replica in replicas[1:]:
            flat.add_(torch.cat([replica[i].detach().reshape(-1) for i in positions]))
        if comm.world_size > 1:
            allreduce(flat, comm=comm)
        flat.div_(total)
        offset = 0
        for i in positions:
            n = replicas[0][i].numel()
            means[i] = flat[offset : offset + n].view_as(replicas[0][i])
            offset += n
    return means


@torch.no_grad()
def broadcast_parameters(
    module: nn.Module, comm: Communicator | None = None, root: int = 0
) -> None:
    """Give every rank ``root``'s parameters and buffers (a tree broadcast per tensor)."""
    comm = comm if comm is not None else Communicator()
    for t in [*module.parameters(), *module.buffers()]:
        tree_broadcast(t.data, comm=comm, root=root)


def replicas_equal(module: nn.Module, group: dist.ProcessGroup | None = None) -> bool:
    """Whether every rank holds bit-identical averaged tensors (for tests and asserts):
    compares each rank's flat copy with rank 0's."""
    flat = torch.cat([t.detach().reshape(-1).double().cpu() for t in averaged_tensors(module)])
    reference = flat.clone()
    dist.broadcast(reference, src=0, group=group)
    same = torch.tensor([int(torch.equal(flat, reference))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN, group=group)
    return bool(same.item())
