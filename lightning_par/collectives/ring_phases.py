"""TEMPORARY (lead's stand-in until the helper's version merges)."""

from __future__ import annotations

import torch

from lightning_par.collectives._common import chunk_sizes, prepare
from lightning_par.collectives.ring_textbook import ring_schedule
from lightning_par.comm import wait_all
from lightning_par.split import offsets as split_offsets


def _phase(tensor, comm, trace, reduce):
    comm, flat = prepare(tensor, None, comm, trace)
    p = comm.world_size
    sizes = chunk_sizes(tensor.numel(), p)
    starts = split_offsets(sizes)
    if flat is None:
        flat = tensor.view(-1)
        return flat[starts[comm.rank] : starts[comm.rank] + sizes[comm.rank]] if reduce else tensor
    rank = comm.rank
    chunk = [flat[starts[c] : starts[c] + sizes[c]] for c in range(p)]
    sched = ring_schedule(rank - 1, p)
    steps = sched[: p - 1] if reduce else sched[p - 1 :]
    right, left = (rank + 1) % p, (rank - 1) % p
    incoming = torch.empty(max(sizes), dtype=flat.dtype, device=flat.device)
    for step, (s, r) in enumerate(steps):
        target = incoming[: sizes[r]] if reduce else chunk[r]
        hs = []
        if sizes[r]:
            hs.append(comm.irecv(target, left, step=step, chunk=r, tag="rs" if reduce else "ag"))
        if sizes[s]:
            hs.append(comm.isend(chunk[s], right, step=step, chunk=s, tag="rs" if reduce else "ag"))
        wait_all(hs)
        if reduce:
            chunk[r].add_(target)
    return chunk[rank] if reduce else tensor


def ring_reduce_scatter(tensor, group=None, *, comm=None, trace=None):
    return _phase(tensor, comm, trace, True)


def ring_all_gather(tensor, group=None, *, comm=None, trace=None):
    return _phase(tensor, comm, trace, False)
