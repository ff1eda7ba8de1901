"""What workers and servers say to each other, on top of :class:`~lightning_par.comm.Communicator`.

Ranks: workers are ``0 .. W-1`` and servers ``W .. W+S-1`` of one process group. Every
exchange starts with a **header** from each worker to each server, a float64 tensor
``[command, step, lr of group 0, lr of group 1, ...]`` (float64 so a scheduler's learning
rate arrives exactly). Then, by command:

* ``STEP``: per gradient bucket, one **push** (tag ``push``: the worker's gradient slices
  for that server followed by one "has a gradient" flag per slice) and one **pull** (tag
  ``pull``: the updated weight slices) per worker and server;
* ``GET_STATE``: each server sends its optimiser state to worker 0 (a pickled object);
* ``SET_STATE``: worker 0 sends the full optimiser state to each server;
* ``STOP``: the server ends.

Before the first header, worker 0 sends each server a :class:`ServerSpec` (or ``None`` when
nothing is trained), then its initial weight slices, which the server sends to all workers.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from lightning_par.comm import Communicator
from lightning_par.paramserver.plan import ShardPlan

STOP, STEP, GET_STATE, SET_STATE = 0, 1, 2, 3
#: How long a server waits for the next header (validation, checkpointing, a slow data
#: loader happen between steps); messages within a step keep the group's timeout.
IDLE_TIMEOUT = timedelta(days=7)


@dataclass
class ServerSpec:
    """What a server needs to know about the model, sent once by worker 0."""

    num_workers: int
    shapes: list[tuple[int, ...]]
    dtype: torch.dtype
    buckets: list[list[int]]  # parameter indices per gradient bucket, in push order
    plan: ShardPlan
    optimizer_cls: type
    groups: list[dict[str, Any]]  # each param group's hyperparameters (no "params")
    group_of: list[int]  # the param group of each parameter
    opt_index: list[int]  # each parameter's index in the worker optimiser's state_dict


def server_rank(num_workers: int, server: int) -> int:
    return num_workers + server


def send_header(
    comm: Communicator, servers: list[int], command: int, step: int = 0, lrs: list[float] = ()
) -> None:
    header = torch.tensor([float(command), float(step), *lrs], dtype=torch.float64)
    handles = [comm.isend(header, s, tag="control") for s in servers]
    for h in handles:
        h.wait()


def recv_headers(comm: Communicator, num_workers: int, num_groups: int) -> list[torch.Tensor]:
    """One header from every worker (waits up to :data:`IDLE_TIMEOUT`: a server is idle
    between steps). The workers must agree on the command."""
    headers = [torch.zeros(2 + num_groups, dtype=torch.float64) for _ in range(num_workers)]
    handles = [comm.irecv(h, w, tag="control") for w, h in enumerate(headers)]
    for h in handles:
        h.wait(IDLE_TIMEOUT)
    commands = {int(h[0]) for h in headers}
    if len(commands) != 1:
        raise RuntimeError(
            f"parameter server rank {comm.rank}: workers disagree on the command "
            f"({[int(h[0]) for h in headers]}); they must call the same hooks in step"
        )
    return headers


def send_object(comm: Communicator, obj: Any, dst: int) -> None:
    """Send a picklable object (spec, optimiser state) as its length, then its bytes."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    comm.send(torch.tensor([data.numel()], dtype=torch.int64), dst, tag="object")
    comm.send(data, dst, tag="object")


def recv_object(comm: Communicator, src: int, timeout: timedelta | None = None) -> Any:
    size = torch.zeros(1, dtype=torch.int64)
    comm.irecv(size, src, tag="object").wait(timeout)
    data = torch.empty(int(size), dtype=torch.uint8)
    comm.recv(data, src, tag="object")
    return pickle.loads(data.numpy().tobytes())
