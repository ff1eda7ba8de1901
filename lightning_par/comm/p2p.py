"""The one communication layer: point-to-point messages over ``torch.distributed``.

All plugins (allreduce collectives, pipeline stages, parameter servers) talk through
:class:`Communicator`. It adds three things to bare ``dist.isend``/``dist.irecv``:

* ranks are local to the process group (translated to global ranks for torch);
* CUDA tensors work on gloo, which can only move CPU tensors, by staging through
  pinned host buffers;
* an optional :class:`~lightning_par.comm.trace.CommTrace` records every message,
  and failures are re-raised naming this rank, its peer and the algorithm step;
* a ``tag`` names the message in the trace; an int tag (e.g. a member of an ``IntEnum``
  of message kinds, as the parameter server's
  :class:`~lightning_par.paramserver.protocol.Kind`) is also the gloo/NCCL tag, so a
  receive matches the next message of that kind from its peer, not just the next message.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from enum import Enum

import torch
import torch.distributed as dist

from lightning_par.comm.trace import CommTrace, Message


class CommError(RuntimeError):
    """A message could not be delivered: a peer died, hung past the timeout, or failed."""


Tag = str | int  # a label for the trace; an int is also the transport's tag


def tag_label(tag: Tag) -> str:
    """How ``tag`` reads in a trace (an enum member: its lower-case name; an int tag with a
    ``label``, e.g. a parameter server's tag of one shard: that label)."""
    if isinstance(tag, Enum):
        return tag.name.lower()
    label = getattr(tag, "label", None)
    if isinstance(label, str):
        return label
    return str(tag) if isinstance(tag, int) else tag


def transport_tag(tag: Tag) -> int:
    """The tag ``dist.isend``/``irecv`` get: an int tag itself, 0 for a label."""
    if isinstance(tag, bool) or not isinstance(tag, int):
        return 0
    if tag < 0:
        raise ValueError(f"a message tag must be >= 0, got {tag}")
    return int(tag)


class Handle:
    """A posted send or receive; :meth:`wait` completes it (and records it in the trace).
    ``str(handle)`` names the message in errors: its tag, step and chunk."""

    def __init__(
        self,
        comm: Communicator,
        op: str,
        peer: int,
        tensor: torch.Tensor,
        staged: torch.Tensor | None,
        start: float,
        step: int | None,
        chunk: int | None,
        tag: Tag,
    ) -> None:
        self._comm, self.op, self.peer = comm, op, peer
        self._tensor, self._staged = tensor, staged
        self._start, self._step, self._chunk, self._tag = start, step, chunk, tag_label(tag)
        #: torch's work, once :meth:`Communicator.post` has posted it (None: nothing to move)
        self.work: dist.Work | None = None
        self._done = False

    def wait(self, timeout: timedelta | None = None) -> torch.Tensor:
        """Complete the message; ``timeout`` overrides the process group's (e.g. a server
        idle between steps waits longer than any message within a step may take)."""
        if self._done:
            return self._tensor
        self._done = True
        trace = self._comm.trace
        waited = trace.now() if trace is not None else None
        if self.work is not None:
            try:
                if timeout is None:
                    self.work.wait()
                else:
                    self.work.wait(timeout)
            except RuntimeError as err:  # gloo/NCCL say "connection closed", "timed out", ...
                raise self._comm.failed(self.op, self.peer, self, err) from err
        if self._staged is not None and self.op == "recv":
            self._tensor.copy_(self._staged, non_blocking=False)
        if trace is not None:
            trace.record(
                Message(
                    rank=self._comm.global_rank,
                    op=self.op,
                    peer=self._comm.global_rank_of(self.peer),
                    nbytes=self._tensor.numel() * self._tensor.element_size(),
                    start=self._start,
                    end=trace.now(),
                    step=self._step,
                    chunk=self._chunk,
                    tag=self._tag,
                    wait_start=waited,
                )
            )
        return self._tensor

    def __str__(self) -> str:
        where = f"step {self._step}, chunk {self._chunk}"
        return f"{self._tag} message, {where}" if self._tag else where


class Communicator:
    """Point-to-point messaging within a process group, with tracing and CUDA-on-gloo staging.

    Ranks given to its methods are ranks within ``group``; the trace records global ranks
    (the same numbers on a subgroup of the whole world, e.g. hybrid parallelism's groups, so
    one trace says who talked to whom).

    Args:
        group: the process group (``None``: the default group).
        trace: where to record messages; ``None`` records nothing (no overhead).
        names: the rank each group rank is recorded as (default: its global rank).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        trace: CommTrace | None = None,
        names: list[int] | None = None,
    ):
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call "
                "lightning_par.comm.init_process_group (or run under a Lightning strategy) first"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group)).lower()
        self.trace = trace
        # Messages go to the process group object itself, with group ranks: torch's
        # ``dist.isend`` wrapper costs tens of microseconds per message in Python (rank
        # translation, group look-ups), which a pipelined collective pays per segment.
        self._pg = group if group is not None else dist.group.WORLD
        # ``names``: how traces and errors name each group rank (a fault-tolerant group
        # re-formed over survivors keeps each rank's first number)
        self._global = names or [self._to_global(r) for r in range(self.world_size)]
        self.global_rank = self._global[self.rank]

    def global_rank_of(self, rank: int) -> int:
        """The global rank of group rank ``rank``."""
        return self._global[rank]

    def _to_global(self, rank: int) -> int:
        if self.group is None or self.group is dist.group.WORLD:
            return rank
        return dist.get_global_rank(self.group, rank)

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(
                f"rank {self.rank}: invalid peer {peer} (world size {self.world_size})"
            )

    def needs_staging(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` goes through a host buffer (a CUDA tensor on gloo)."""
        return tensor.device.type != "cpu" and self.backend == "gloo"

    def failed(self, op: str, peer: int, what: object, err: Exception) -> CommError:
        """The error of a message to or from group rank ``peer`` that failed as it was posted
        or while it was waited for (``str(what)`` names the message, made only then)."""
        name = self.global_rank_of(peer)
        return CommError(
            f"rank {self.global_rank}: {op} {'to' if op == 'send' else 'from'} rank {name} "
            f"failed ({what}): {err}. If rank {name} died or hangs, look at its own error above."
        )

    def post(
        self, op: str, tensor: torch.Tensor, peer: int, what: object, tag: int = 0
    ) -> dist.Work:
        """Post one message (``op``: ``"send"`` or ``"recv"``) of a contiguous ``tensor`` that
        needs no staging, and return torch's work. Collectives that post many messages call
        it untraced, with :meth:`complete` (:meth:`isend`'s checks and :class:`Handle` cost
        ~10 us a message on a slow core). A peer whose connection closed already fails here,
        at once (gloo raises on posting), with the error of a failed wait (:meth:`failed`)."""
        try:
            return (self._pg.send if op == "send" else self._pg.recv)([tensor], peer, tag)
        except RuntimeError as err:
            raise self.failed(op, peer, what, err) from err

    def complete(self, work: dist.Work, op: str, peer: int, what: object) -> None:
        """Wait for a message posted by :meth:`post`."""
        try:
            work.wait()
        except RuntimeError as err:
            raise self.failed(op, peer, what, err) from err

    @staticmethod
    def _host_buffer(tensor: torch.Tensor) -> torch.Tensor:
        # A fresh buffer per message, so messages in flight at once never share one; torch's
        # caching host allocator makes this a cheap reuse rather than a new pinning.
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)

    def isend(
        self,
        tensor: torch.Tensor,
        dst: int,
        *,
        step: int | None = None,
        chunk: int | None = None,
        tag: Tag = "",
    ) -> Handle:
        """Post a send of ``tensor`` to group rank ``dst``; the tensor must not change until
        the handle is waited on."""
        self._check_peer(dst)
        start = self.trace.now() if self.trace is not None else 0.0
        staged = None
        payload = tensor if tensor.is_contiguous() else tensor.contiguous()
        if self.needs_staging(tensor):
            staged = self._host_buffer(tensor).copy_(tensor)
            payload = staged
        handle = Handle(self, "send", dst, tensor, staged, start, step, chunk, tag)
        if tensor.numel():
            handle.work = self.post("send", payload, dst, handle, transport_tag(tag))
        return handle

    def irecv(
        self,
        tensor: torch.Tensor,
        src: int,
        *,
        step: int | None = None,
        chunk: int | None = None,
        tag: Tag = "",
    ) -> Handle:
        """Post a receive into ``tensor`` (contiguous) from group rank ``src``."""
        self._check_peer(src)
        if not tensor.is_contiguous():
            raise ValueError("irecv needs a contiguous tensor to receive into")
        start = self.trace.now() if self.trace is not None else 0.0
        staged = self._host_buffer(tensor) if self.needs_staging(tensor) else None
        target = staged if staged is not None else tensor
        handle = Handle(self, "recv", src, tensor, staged, start, step, chunk, tag)
        if tensor.numel():
            handle.work = self.post("recv", target, src, handle, transport_tag(tag))
        return handle

    def send(self, tensor: torch.Tensor, dst: int, **kw) -> None:
        self.isend(tensor, dst, **kw).wait()

    def recv(self, tensor: torch.Tensor, src: int, **kw) -> torch.Tensor:
        return self.irecv(tensor, src, **kw).wait()

    def sendrecv(
        self,
        send_tensor: torch.Tensor,
        dst: int,
        recv_tensor: torch.Tensor,
        src: int,
        **kw,
    ) -> torch.Tensor:
        """Send to ``dst`` and receive from ``src`` at the same time (no deadlock)."""
        handles = [self.irecv(recv_tensor, src, **kw), self.isend(send_tensor, dst, **kw)]
        wait_all(handles)
        return recv_tensor


def wait_all(handles: Sequence[Handle]) -> None:
    for handle in handles:
        handle.wait()
