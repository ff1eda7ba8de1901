"""Moving the parameter-server messages that need more than one send or receive over a
:class:`~lightning_par.comm.Communicator`: headers to every server, objects (length, then
bytes), the servers' exchange of squared norms. Every tensor sent here comes from an encoder
of :mod:`~lightning_par.paramserver.protocol` and every one received goes through its
decoder; no layout is built or read here."""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

from lightning_par.comm import CommError, Communicator, Handle, wait_all
from lightning_par.comm.p2p import Tag
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
    comm: Communicator, num_workers: int, num_hyper: int, idle: timedelta,
    tag: Tag = Kind.HEADER,
) -> list[Header]:  # fmt: skip
    """One header from every worker (waits up to ``idle`` for worker 0's: a server is idle
    between steps), on ``tag`` (a shard's own, with ``fault_tolerant``). The workers must
    agree on the command."""
    buffers = [Header.buffer(num_hyper) for _ in range(num_workers)]
    handles = [comm.irecv(b, w, tag=tag) for w, b in enumerate(buffers)]
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


def send_object(comm: Communicator, obj: Any, dst: int, tag: Tag = Kind.OBJECT) -> None:
    """Send a spec or an optimiser state (:func:`.protocol.encode_object`)."""
    size, data = protocol.encode_object(obj)
    comm.send(size, dst, tag=tag)
    comm.send(data, dst, tag=tag)


def recv_object(
    comm: Communicator, src: int, decode: Callable[[torch.Tensor], Any] = protocol.decode_object,
    timeout: timedelta | None = None, tag: Tag = Kind.OBJECT,
) -> Any:  # fmt: skip
    """The next object from ``src`` (waits up to ``timeout`` for its length), read by
    ``decode`` (:func:`~lightning_par.paramserver.protocol.decode_spec`, ``decode_state``)."""
    return decode(recv_object_bytes(comm, src, timeout, tag)[1])


def recv_object_bytes(
    comm: Communicator, src: int, timeout: timedelta | None = None, tag: Tag = Kind.OBJECT
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two messages of the next object from ``src``, as they came (its length, then its
    bytes): a server with a backup passes them on unread."""
    size = protocol.object_size_buffer()
    comm.irecv(size, src, tag=tag).wait(timeout)
    data = torch.empty(protocol.decode_object_size(size, f"rank {src}"), dtype=torch.uint8)
    comm.recv(data, src, tag=tag)
    return size, data


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


#: Where shard ``s`` leaves its squared norm of step ``t`` (``fault_tolerant``).
NORM_KEY = "lightning_par/paramserver/norm/{}/{}"


def exchange_norms_in_store(store: Any, num_shards: int, me: int, mine: float, step: int,
                            timeout: timedelta) -> float:  # fmt: skip
    """:func:`exchange_squared_norms` through the group's store (``fault_tolerant``): a shard
    leaves its squared norm of ``step`` under its own key and reads every other shard's, so
    whichever process holds a shard (a lost server's backup redoing its step leaves the same
    number) the others find it; summed in shard order, as the exchange does. The key of the
    step before is deleted (every shard read it: this step's pushes came after its pulls).
    The store is polled, not waited on: a wait would hold the store's connection, which the
    heartbeat shares."""
    store.set(NORM_KEY.format(step, me), struct.pack("<d", mine))
    store.delete_key(NORM_KEY.format(step - 1, me))
    deadline, pause, total = time.monotonic() + timeout.total_seconds(), 1e-4, 0.0
    for s in range(num_shards):
        key = NORM_KEY.format(step, s)
        while not store.check([key]):
            if time.monotonic() > deadline:
                raise CommError(f"shard {s}'s squared norm of step {step} never came (waited "
                                f"{timeout.total_seconds():g} s)")  # fmt: skip
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
        total += struct.unpack("<d", store.get(key))[0] if s != me else mine
    return total


__all__ = ["exchange_norms_in_store", "exchange_squared_norms", "post_headers", "recv_header",
           "recv_headers", "recv_object", "recv_object_bytes", "send_headers",
           "send_object"]  # fmt: skip
