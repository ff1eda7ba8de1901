"""Headers and objects over a :class:`~lightning_par.comm.Communicator` (the layouts and
tags are in :mod:`~lightning_par.paramserver.protocol`)."""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

import torch

from lightning_par.comm import CommError, Communicator, Handle
from lightning_par.paramserver.protocol import Header, Kind


def post_headers(comm: Communicator, servers: list[int], header: Header) -> list[Handle]:
    """Post ``header`` to every server without waiting (a worker blocked on one server's
    header while another server waits for its push could deadlock two servers against
    two workers)."""
    message = header.encode()
    return [comm.isend(message, s, step=header.step, tag=Kind.HEADER) for s in servers]


def send_headers(comm: Communicator, servers: list[int], header: Header) -> None:
    """Send ``header`` to every server and wait until all have taken it."""
    for handle in post_headers(comm, servers, header):
        handle.wait()


def recv_header(
    comm: Communicator, worker: int, num_hyper: int, timeout: timedelta | None = None
) -> Header:
    """The next header from ``worker`` (``timeout``: as :meth:`~lightning_par.comm.Handle.wait`)."""
    buffer = Header.buffer(num_hyper)
    comm.irecv(buffer, worker, tag=Kind.HEADER).wait(timeout)
    return Header.decode(buffer, num_hyper, f"worker {worker} (rank {worker})")


def recv_headers(
    comm: Communicator, num_workers: int, num_hyper: int, idle: timedelta
) -> list[Header]:
    """One header from every worker (waits up to ``idle`` for worker 0's: a server is idle
    between steps). The workers must agree on the command."""
    buffers = [Header.buffer(num_hyper) for _ in range(num_workers)]
    handles = [comm.irecv(b, w, tag=Kind.HEADER) for w, b in enumerate(buffers)]
    handles[0].wait(idle)
    first = Header.decode(buffers[0], num_hyper, "worker 0 (rank 0)")
    # Worker 0's header opens the exchange; the others, in lockstep with it, get the group's
    # timeout from then on, so a hung worker is named here rather than waited for a week.
    for w, handle in enumerate(handles[1:], start=1):
        try:
            handle.wait()
        except CommError as err:
            raise CommError(
                f"worker {w} (rank {w}) sent nothing for step {first.step} (command "
                f"{first.command.name}) within the timeout after worker 0 did: worker {w} "
                f"hangs or died ({err})"
            ) from err
    headers = [first] + [
        Header.decode(b, num_hyper, f"worker {w} (rank {w})")
        for w, b in enumerate(buffers[1:], start=1)
    ]
    if len({h.command for h in headers}) != 1:
        raise RuntimeError(
            f"parameter server rank {comm.rank}: workers disagree on the command "
            f"({[h.command.name for h in headers]}); they must call the same hooks in step"
        )
    return headers


def send_object(comm: Communicator, obj: Any, dst: int) -> None:
    """Send a picklable object (spec, optimiser state) as its length, then its bytes."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    comm.send(torch.tensor([data.numel()], dtype=torch.int64), dst, tag=Kind.OBJECT)
    comm.send(data, dst, tag=Kind.OBJECT)


def recv_object(comm: Communicator, src: int, timeout: timedelta | None = None) -> Any:
    """An object :func:`send_object` sent (waits up to ``timeout`` for its length)."""
    size = torch.zeros(1, dtype=torch.int64)
    comm.irecv(size, src, tag=Kind.OBJECT).wait(timeout)
    data = torch.empty(int(size), dtype=torch.uint8)
    comm.recv(data, src, tag=Kind.OBJECT)
    return pickle.loads(data.numpy().tobytes())
