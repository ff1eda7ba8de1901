"""Headers and objects over a :class:`~lightning_par.comm.Communicator` (the layouts and
tags are in :mod:`~lightning_par.paramserver.protocol`; objects are encoded without pickle
by :mod:`~lightning_par.paramserver.wire`)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from lightning_par.comm import CommError, Communicator, Handle
from lightning_par.paramserver import wire
from lightning_par.paramserver.protocol import Command, Header, Kind, server_rank


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
    """Send a spec or an optimiser state as its length, then its bytes
    (:func:`lightning_par.paramserver.wire.encode`: JSON and tensor data, no pickle)."""
    data = torch.frombuffer(bytearray(wire.encode(obj)), dtype=torch.uint8)
    comm.send(torch.tensor([data.numel()], dtype=torch.int64), dst, tag=Kind.OBJECT)
    comm.send(data, dst, tag=Kind.OBJECT)


def recv_object(comm: Communicator, src: int, timeout: timedelta | None = None) -> Any:
    """An object :func:`send_object` sent (waits up to ``timeout`` for its length); bytes
    in any other format (a pickle) are refused
    (:class:`~lightning_par.paramserver.wire.WireError`)."""
    size = torch.zeros(1, dtype=torch.int64)
    comm.irecv(size, src, tag=Kind.OBJECT).wait(timeout)
    if not 0 <= int(size) <= MAX_OBJECT_BYTES:
        raise wire.WireError(f"refused an object of {int(size)} bytes from rank {src}")
    data = torch.empty(int(size), dtype=torch.uint8)
    comm.recv(data, src, tag=Kind.OBJECT)
    return wire.decode(data.numpy().tobytes())


#: The largest object a rank accepts (an optimiser state of a few GiB models fits).
MAX_OBJECT_BYTES = 1 << 36


def close_untrained(comm: Communicator, num_workers: int, num_servers: int) -> None:
    """Worker 0, when nothing was trained (``fit`` ended before any step): tell every server
    to end. The servers wait for a spec first; ``None`` in its place means "stop"."""
    for s in range(num_servers):
        send_object(comm, None, server_rank(num_workers, s))


__all__ = ["Command", "close_untrained", "post_headers", "recv_header", "recv_headers",
           "recv_object", "send_headers", "send_object"]  # fmt: skip
