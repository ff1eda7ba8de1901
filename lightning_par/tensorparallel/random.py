"""One random stream for all the ranks of a tensor-parallel group.

Every rank computes the replicated layers whole, so a dropout there must draw the same mask
on every rank, and :class:`~lightning_par.tensorparallel.embedding.ShardedDropout` draws the
whole activation's mask from the same stream as one process would. Both hold when every
rank's generator is in the same state when training starts and every rank then draws the
same numbers, which the split layers guarantee. Megatron-LM's ``random.py`` instead keeps
one stream for replicated regions and a per-rank one for split regions (its RNG tracker):
faster for the split dropout, but other masks than one process's.
"""

from __future__ import annotations

import torch

from lightning_par.collectives.tree import tree_broadcast
from lightning_par.comm import Communicator


def _shared(state: torch.Tensor, comm: Communicator, device: torch.device) -> torch.Tensor:
    buffer = state.to(device)  # NCCL moves device tensors only
    tree_broadcast(buffer, comm=comm, root=0)
    return buffer.cpu()


def share_random_state(comm: Communicator, device: torch.device) -> None:
    """Give every rank of ``comm`` the random state of its rank 0: the CPU generator and,
    on a GPU, that device's generator."""
    if comm.world_size == 1:
        return
    torch.set_rng_state(_shared(torch.get_rng_state(), comm, device))
    if device.type == "cuda":
        torch.cuda.set_rng_state(_shared(torch.cuda.get_rng_state(device), comm, device), device)
