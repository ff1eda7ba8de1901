"""Moving the parameter-server messages that need more than one send or receive over a
:class:`~lightning_par.comm.Communicator`: headers to every server, objects (length, then
bytes), the servers' exchange of squared norms. Every tensor sent here comes from an encoder
of :mod:`~lightning_par.paramserver.protocol` and every one received goes through its
decoder; no layout is built or read here."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

from lightning_par.comm import CommError, Communicator, Handle, wait_all
from lightning_par.paramserver import protocol
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
    """Send a spec or an optimiser state (:func:`.protocol.encode_object`)."""
    size, data = protocol.encode_object(obj)
    comm.send(size, dst, tag=Kind.OBJECT)
    comm.send(data, dst, tag=Kind.OBJECT)


def recv_object(
    comm: Communicator, src: int, decode: Callable[[torch.Tensor], Any] = protocol.decode_object,
    timeout: timedelta | None = None,
) -> Any:  # fmt: skip
    """The next object from ``src`` (waits up to ``timeout`` for its length), read by
    ``decode`` (:func:`~lightning_par.paramserver.protocol.decode_spec`, ``decode_state``)."""
    size = protocol.object_size_buffer()
    comm.irecv(size, src, tag=Kind.OBJECT).wait(timeout)
    data = torch.empty(protocol.decode_object_size(size, f"rank {src}"), dtype=torch.uint8)
    comm.recv(data, src, tag=Kind.OBJECT)
    return decode(data)


def exchange_squared_norms(
    comm: Communicator, servers: Sequence[int], me: int, mine: float, step: int
) -> float:
    """The whole gradient's squared norm: this server's (``servers[me]``) sent to every
    other server (``NORM``), theirs received, all summed in server order (the same on every
    server; :mod:`~lightning_par.paramserver.clipping`)."""
    theirs = {s: protocol.norm_buffer() for s in range(len(servers)) if s != me}
    handles = [comm.irecv(buf, servers[s], step=step, tag=Kind.NORM) for s, buf in theirs.items()]
    own = protocol.encode_norm(mine)
    handles += [comm.isend(own, servers[s], step=step, tag=Kind.NORM) for s in theirs]
    wait_all(handles)
    return sum(protocol.decode_norm(theirs[s]) if s != me else mine for s in range(len(servers)))


__all__ = ["exchange_squared_norms", "post_headers", "recv_header", "recv_headers",
           "recv_object", "send_headers", "send_object"]  # fmt: skip
