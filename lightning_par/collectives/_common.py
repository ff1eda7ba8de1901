"""Shared plumbing for the collectives: resolving the communicator, flat views, chunking."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from lightning_par.comm import CommTrace, Communicator, Handle
from lightning_par.split import even_sizes


def resolve_communicator(
    group: dist.ProcessGroup | None, comm: Communicator | None, trace: CommTrace | None
) -> Communicator:
    """The communicator to use: ``comm`` if given, else one on ``group`` with ``trace``
    (untraced calls on the default group share one: making it costs ~30 us, a call)."""
    if comm is not None:
        if group is not None and comm.group is not group:
            raise ValueError("pass either a process group or a Communicator, not both")
        if trace is not None and comm.trace is not trace:
            raise ValueError("the Communicator already has a trace; pass the trace to it instead")
        return comm
    if group is None and trace is None:
        world = dist.group.WORLD
        shared = _default.get(id(world)) if world is not None else None
        if shared is None or shared._pg is not world:  # a new default group
            _default.clear()
            shared = _default[id(world)] = Communicator()
        return shared
    return Communicator(group, trace=trace)


#: The untraced Communicator on the current default group (cleared when it changes).
_default: dict[int, Communicator] = {}


def check_tensor(tensor: torch.Tensor, collective: str = "allreduce") -> None:
    """Refuse what ``collective`` cannot move and sum, naming it and the fix."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{collective} needs a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype == torch.bool:
        raise TypeError(
            f"{collective} cannot take a bool tensor; convert it first, e.g. tensor.int()"
        )


def prepare(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    comm: Communicator | None,
    trace: CommTrace | None,
    collective: str = "allreduce",
) -> tuple[Communicator, torch.Tensor | None]:
    """What every collective does first: check ``tensor`` (errors name ``collective``), pick
    the communicator, and take a flat work view; the view is ``None`` when there is nothing
    to exchange (one rank, or an empty tensor)."""
    check_tensor(tensor, collective)
    comm = resolve_communicator(group, comm, trace)
    if comm.world_size == 1 or tensor.numel() == 0:
        return comm, None
    return comm, flat_work(tensor)


def flat_work(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view of ``tensor`` to reduce in place (a contiguous copy if it is not contiguous;
    :func:`finish` copies the result back)."""
    return (tensor if tensor.is_contiguous() else tensor.contiguous()).view(-1)


def finish(tensor: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
    return tensor


def chunk_sizes(numel: int, parts: int) -> list[int]:
    """Split ``numel`` elements into ``parts`` chunks whose sizes differ by at most one
    (:func:`lightning_par.split.even_sizes`: a tensor smaller than the world size gives some
    empty chunks)."""
    return even_sizes(numel, parts)


def segment_elems_for(segment_bytes: int | None, element_size: int) -> int | None:
    if segment_bytes is None:
        return None
    if segment_bytes <= 0:
        raise ValueError(f"segment_bytes must be > 0 bytes (or None), got {segment_bytes}")
    return max(1, segment_bytes // element_size)


def depth_in_heap(index: int) -> int:
    """Depth of node ``index`` in a binary heap (root 0, children ``2i+1`` and ``2i+2``)."""
    return (index + 1).bit_length() - 1


_workspace = threading.local()


def scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A receive buffer reused across calls (per thread, dtype and device).

    Allocating tens of megabytes per call costs page faults on every first touch; reusing
    one buffer per thread keeps the hot loop allocation-free.
    """
    numel = 1
    for n in shape:
        numel *= n
    cache = _workspace.__dict__.setdefault("buffers", {})
    key = (dtype, device)
    buf = cache.get(key)
    if buf is None or buf.numel() < numel:
        buf = cache[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel].view(shape)


def scratch_rows(rows: int, length: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """``rows`` 1-D receive buffers of ``length`` elements in :func:`scratch`'s buffer, their
    views made once per buffer: slicing a 2-D buffer into rows costs ~30 us a call on a
    slow core."""
    made = _workspace.__dict__.setdefault("rows", {})
    key = (rows, length, dtype, device)
    hit = made.get(key)
    if hit is not None and hit[0] is _workspace.buffers.get((dtype, device)):
        return hit[1]
    views = scratch((rows, length), dtype, device).unbind(0)
    made[key] = (_workspace.buffers[(dtype, device)], views)  # (a larger buffer: made again)
    return views


def ordered_exchange(
    comm: Communicator,
    sends: list[tuple[torch.Tensor, dict]],
    recvs: list[tuple[torch.Tensor, dict]],
    peer: int,
) -> list[Handle]:
    """Post sends to and receives from one ``peer``, the lower rank sending first.

    NCCL runs all messages between two ranks on one stream in posting order, so if both
    ranks posted their (large) send first, each would wait for a receive queued behind it.
    Posting in rank order pairs every send with the peer's receive; gloo does not care.
    Each entry is ``(tensor, trace keywords)``.
    """
    post_sends = [lambda t=t, kw=kw: comm.isend(t, peer, **kw) for t, kw in sends]
    post_recvs = [lambda t=t, kw=kw: comm.irecv(t, peer, **kw) for t, kw in recvs]
    order = post_sends + post_recvs if comm.rank < peer else post_recvs + post_sends
    return [post() for post in order]
