"""What workers and servers say to each other, on top of :class:`~lightning_par.comm.Communicator`.

Ranks: workers are ``0 .. W-1`` and servers ``W .. W+S-1`` of one process group. Every
exchange starts with a **header** from each worker to each server, a float64 tensor
``[command, step, hyperparameters of group 0, of group 1, ...]``: every number in each
param group (``lr``, ``momentum``, ``betas``, ``weight_decay``, ...), so what a scheduler
changes on the workers (OneCycle's learning rate and momentum) reaches the servers, in
float64 so it arrives exactly. Then, by command:

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

from lightning_par.comm import CommError, Communicator
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
    schemas: list[Schema]  # the numbers of each group that travel in every header
    group_of: list[int]  # the param group of each parameter
    opt_index: list[int]  # each parameter's index in the worker optimiser's state_dict


Schema = list[tuple[str, int | None]]  # (key, index in a tuple value or None) per number


def hyper_schema(group: dict[str, Any]) -> Schema:
    """Where the numbers of a param group are (keys in sorted order)."""
    schema: Schema = []
    for key, value in sorted(group.items()):
        if key == "params" or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            schema.append((key, None))
        elif isinstance(value, tuple) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
        ):
            schema += [(key, i) for i in range(len(value))]
    return schema


def hyper_values(groups: list[dict[str, Any]], schemas: list[Schema]) -> list[float]:
    return [
        float(g[k] if i is None else g[k][i]) for g, schema in zip(groups, schemas)
        for k, i in schema
    ]  # fmt: skip


def set_hyper(group: dict[str, Any], schema: Schema, values: list[float]) -> None:
    for (key, i), value in zip(schema, values):
        if i is None:
            group[key] = type(group[key])(value)
        else:
            items = list(group[key])
            items[i] = type(items[i])(value)
            group[key] = tuple(items)


def server_rank(num_workers: int, server: int) -> int:
    return num_workers + server


def send_header(
    comm: Communicator, servers: list[int], command: int, step: int = 0, hyper: list[float] = ()
) -> None:
    header = torch.tensor([float(command), float(step), *hyper], dtype=torch.float64)
    handles = [comm.isend(header, s, tag="control") for s in servers]
    for h in handles:
        h.wait()


def recv_headers(comm: Communicator, num_workers: int, num_values: int) -> list[torch.Tensor]:
    """One header from every worker (waits up to :data:`IDLE_TIMEOUT`: a server is idle
    between steps). The workers must agree on the command."""
    headers = [torch.zeros(2 + num_values, dtype=torch.float64) for _ in range(num_workers)]
    handles = [comm.irecv(h, w, tag="control") for w, h in enumerate(headers)]
    handles[0].wait(IDLE_TIMEOUT)
    # Worker 0's header opens the exchange; the others, in lockstep with it, get the group's
    # timeout from then on, so a hung worker is named here rather than waited for a week.
    for w, handle in enumerate(handles[1:], start=1):
        try:
            handle.wait()
        except CommError as err:
            raise CommError(
                f"worker {w} (rank {w}) sent nothing for "
                f"step {int(headers[0][1])} (command {int(headers[0][0])}) within the timeout "
                f"after worker 0 did: worker {w} hangs or died ({err})"
            ) from err
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
