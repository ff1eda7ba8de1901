"""Teaching baselines: all-to-all and master-worker allreduce (course slides 003, 43-44).

* **All-to-all**: every rank sends its whole tensor to every other rank and adds up what
  it receives. One step, but ``(p - 1) n`` elements leave every rank: "too many
  unnecessary messages".
* **Master-worker**: every worker sends its tensor to rank 0, which adds them and sends
  the sum back. Two steps, but rank 0 moves ``(p - 1) n`` elements each way: "the master
  becomes a bottleneck" (the centralised design that parameter servers refine).

Both add the tensors in rank order (``x0 + x1 + ...``), so every rank gets identical bits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_par.collectives._common import (
    finish,
    ordered_exchange,
    prepare,
)
from lightning_par.comm import CommTrace, Communicator, wait_all

MASTER = 0


def all_to_all_allreduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    comm: Communicator | None = None,
    trace: CommTrace | None = None,
) -> torch.Tensor:
    """Sum ``tensor`` in place: everyone sends everything to everyone (trace step 0)."""
    comm, flat = prepare(tensor, group, comm, trace)
    if flat is None:
        return tensor
    p, rank = comm.world_size, comm.rank
    gathered = torch.empty((p, flat.numel()), dtype=flat.dtype, device=flat.device)
    gathered[rank].copy_(flat)
    kw = {"step": 0, "tag": "all-to-all"}
    handles = []
    for r in range(p):
        if r != rank:
            handles += ordered_exchange(comm, [(flat, kw)], [(gathered[r], kw)], r)
    wait_all(handles)
    flat.copy_(gathered[0])
    for r in range(1, p):
        flat.add_(gathered[r])
    return finish(tensor, flat)


def master_worker_allreduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    comm: Communicator | None = None,
    trace: CommTrace | None = None,
) -> torch.Tensor:
    """Sum ``tensor`` in place: gather at rank 0 (step 0), add, send the sum back (step 1)."""
    comm, flat = prepare(tensor, group, comm, trace)
    if flat is None:
        return tensor
    p, rank = comm.world_size, comm.rank
    if rank != MASTER:
        comm.send(flat, MASTER, step=0, tag="gather")
        comm.recv(flat, MASTER, step=1, tag="scatter-result")
        return finish(tensor, flat)
    workers = range(1, p)
    incoming = torch.empty((p - 1, flat.numel()), dtype=flat.dtype, device=flat.device)
    handles = [comm.irecv(incoming[w - 1], w, step=0, tag="gather") for w in workers]
    for handle, buf in zip(handles, incoming):
        handle.wait()
        flat.add_(buf)
    wait_all([comm.isend(flat, w, step=1, tag="scatter-result") for w in workers])
    return finish(tensor, flat)
