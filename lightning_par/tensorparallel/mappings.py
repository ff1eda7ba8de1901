"""Megatron's conjugate operators, built from this project's own point-to-point messages.

Megatron-LM (Shoeybi et al., 2019, "Megatron-LM: Training Multi-Billion Parameter Language
Models Using Model Parallelism", arXiv:1909.08053, section 3) keeps every activation in one
of two states, *replicated* (the same on every rank, with the same gradient on every rank)
or *split* (each rank holds a slice of the features), and moves between them with small
autograd functions:

============================  ==============================  ============================
operator                      forward                         backward
============================  ==============================  ============================
``f``  (:func:`copy_to`)      identity                        allreduce of the gradient
``g``  (:func:`reduce_from`)  allreduce of partial sums       identity
:func:`gather_from`           all-gather the slices           keep this rank's slice
:func:`split_to`              keep this rank's slice          all-gather the gradient
:func:`gather_recurrent`      all-gather (two outputs)        reduce-scatter + own slice
============================  ==============================  ============================

``f`` sits before a column-parallel layer (each rank's slice of the weight sees the whole
input, so each rank's input gradient is a partial sum), ``g`` after a row-parallel layer
(each rank's slice of the input gives a partial output). :func:`gather_recurrent` is for a
split LSTM: its gathered hidden state feeds the next time step's split gates (partial
gradients, summed by the reduce-scatter) and the layer's replicated output at once.

Allreduces use :data:`lightning_par.collectives.ALGORITHMS` (ring by default); all-gather
and reduce-scatter are rings over the ranks' (possibly unequal) slices. Every message goes
through :class:`~lightning_par.comm.Communicator`, tagged ``tp:f``, ``tp:g``, ``tp:gather``
or ``tp:reduce_scatter``, so a trace shows which operator sent it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_par.collectives import get_allreduce
from lightning_par.collectives._common import ordered_exchange
from lightning_par.comm import Communicator, Handle, wait_all
from lightning_par.split import offsets as split_offsets


@dataclass
class TPGroup:
    """The ranks one layer is split over: a communicator on their process group and the
    allreduce algorithm ``f`` and ``g`` use."""

    comm: Communicator
    algorithm: str = "ring"
    _allreduce: object = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._allreduce = get_allreduce(self.algorithm)

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def allreduce(self, tensor: torch.Tensor, tag: str) -> torch.Tensor:
        """The sum over the ranks, in a new tensor (``tensor`` is left alone)."""
        out = tensor.detach().clone(memory_format=torch.contiguous_format)
        if self.world_size > 1:
            self._allreduce(out, comm=_Tagged(self.comm, tag))
        return out


class _Tagged:
    """A view of a communicator that labels every message with ``tag`` (the collective's
    own tags, ``reduce-scatter``/``all-gather``, become ``tp:f/reduce-scatter`` ...)."""

    def __init__(self, comm: Communicator, tag: str) -> None:
        self._comm, self._tag = comm, tag
        self.group, self.trace = comm.group, comm.trace
        self.rank, self.world_size, self.backend = comm.rank, comm.world_size, comm.backend

    def isend(self, tensor, dst, *, tag: str = "", **kw) -> Handle:
        return self._comm.isend(tensor, dst, tag=f"{self._tag}/{tag}" if tag else self._tag, **kw)

    def irecv(self, tensor, src, *, tag: str = "", **kw) -> Handle:
        return self._comm.irecv(tensor, src, tag=f"{self._tag}/{tag}" if tag else self._tag, **kw)

    def send(self, tensor, dst, **kw) -> None:
        self.isend(tensor, dst, **kw).wait()

    def recv(self, tensor, src, **kw) -> torch.Tensor:
        return self.irecv(tensor, src, **kw).wait()

    # untraced messages carry no label: the communicator's own path (Communicator.post)
    def needs_staging(self, tensor: torch.Tensor) -> bool:
        return self._comm.needs_staging(tensor)

    def post(self, op: str, tensor: torch.Tensor, peer: int, what: object) -> Any:
        return self._comm.post(op, tensor, peer, what)

    def complete(self, work: Any, op: str, peer: int, what: object) -> None:
        self._comm.complete(work, op, peer, what)


# ---- all-gather and reduce-scatter of unequal slices along one dimension ---------------------
def _exchange(
    comm: Communicator,
    send: torch.Tensor,
    recv: torch.Tensor,
    step: int,
    chunk_sent: int,
    chunk_recv: int,
    tag: str,
) -> None:
    """One ring step: ``send`` to the right neighbour, ``recv`` from the left one."""
    p, r = comm.world_size, comm.rank
    sent = {"step": step, "chunk": chunk_sent, "tag": tag}
    got = {"step": step, "chunk": chunk_recv, "tag": tag}
    if p == 2:  # both neighbours are one rank: post in rank order (NCCL, see ordered_exchange)
        wait_all(ordered_exchange(comm, [(send, sent)], [(recv, got)], 1 - r))
        return
    handles = [comm.irecv(recv, (r - 1) % p, **got)] if recv.numel() else []
    if send.numel():
        handles.append(comm.isend(send, (r + 1) % p, **sent))
    wait_all(handles)


def all_gather(local: torch.Tensor, sizes: Sequence[int], dim: int, group: TPGroup) -> torch.Tensor:
    """Concatenate every rank's slice (``sizes[k]`` long along ``dim`` on rank ``k``) in rank
    order: a ring in which rank ``r`` sends every slice but ``(r + 1) mod p``."""
    comm, p, r = group.comm, group.world_size, group.rank
    moved = local.detach().movedim(dim, 0).contiguous()
    full = moved.new_empty((sum(sizes), *moved.shape[1:]))
    starts = split_offsets(sizes)
    piece = lambda k: full[starts[k] : starts[k] + sizes[k]]  # noqa: E731
    piece(r).copy_(moved)
    for step in range(p - 1):
        send, recv = (r - step) % p, (r - step - 1) % p
        _exchange(comm, piece(send), piece(recv), step, send, recv, "tp:gather")
    return full.movedim(0, dim)


def reduce_scatter(
    full: torch.Tensor, sizes: Sequence[int], dim: int, group: TPGroup
) -> torch.Tensor:
    """This rank's slice (``sizes[rank]`` along ``dim``) of the sum of every rank's ``full``:
    a ring in which rank ``r`` sends every slice but its own."""
    comm, p, r = group.comm, group.world_size, group.rank
    work = full.detach().movedim(dim, 0).contiguous()  # a copy: the sums build up in it
    if work.data_ptr() == full.data_ptr():
        work = work.clone()
    starts = split_offsets(sizes)
    piece = lambda k: work[starts[k] : starts[k] + sizes[k]]  # noqa: E731
    buffer = work.new_empty((max(sizes), *work.shape[1:]))
    for step in range(p - 1):
        send, recv = (r - step - 1) % p, (r - step - 2) % p
        target = buffer[: sizes[recv]]
        _exchange(comm, piece(send), target, step, send, recv, "tp:reduce_scatter")
        piece(recv).add_(target)
    return piece(r).movedim(0, dim).contiguous()


def local_slice(full: torch.Tensor, sizes: Sequence[int], dim: int, rank: int) -> torch.Tensor:
    start = split_offsets(sizes)[rank]
    return full.narrow(dim, start, sizes[rank])


# ---- the autograd functions ---------------------------------------------------------------------
class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.group.allreduce(grad, "tp:f"), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        return group.allreduce(x, "tp:g")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: TPGroup, sizes: tuple[int, ...], dim: int):
        ctx.group, ctx.sizes, ctx.dim = group, sizes, dim
        return all_gather(x, sizes, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        own = local_slice(grad, ctx.sizes, ctx.dim, ctx.group.rank)
        return own.contiguous(), None, None, None


class _SplitTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: TPGroup, sizes: tuple[int, ...], dim: int):
        ctx.group, ctx.sizes, ctx.dim = group, sizes, dim
        return local_slice(x, sizes, dim, group.rank).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather(grad, ctx.sizes, ctx.dim, ctx.group), None, None, None


class _GatherRecurrent(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: TPGroup, sizes: tuple[int, ...], dim: int):
        ctx.group, ctx.sizes, ctx.dim = group, sizes, dim
        ctx.set_materialize_grads(False)  # the last step's state feeds no step: no message
        full = all_gather(x, sizes, dim, group)
        return full, full.clone()

    @staticmethod
    def backward(ctx, grad_recurrent: torch.Tensor | None, grad_output: torch.Tensor | None):
        group, sizes, dim = ctx.group, ctx.sizes, ctx.dim
        grad = None
        if grad_recurrent is not None:  # partial sums: each rank's gates used the whole state
            grad = reduce_scatter(grad_recurrent, sizes, dim, group)
        if grad_output is not None:  # replicated: every rank has the whole gradient already
            own = local_slice(grad_output, sizes, dim, group.rank)
            grad = own.contiguous() if grad is None else grad + own
        return grad, None, None, None


def copy_to(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Megatron's ``f``: identity forward, allreduce of the gradient backward."""
    return _CopyTo.apply(x, group) if group.world_size > 1 else x


def reduce_from(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Megatron's ``g``: allreduce forward (partial sums to the whole), identity backward."""
    return _ReduceFrom.apply(x, group) if group.world_size > 1 else x


def gather_from(x: torch.Tensor, group: TPGroup, sizes: Sequence[int], dim: int) -> torch.Tensor:
    """Split to replicated: all-gather along ``dim`` forward, own slice backward."""
    return _GatherFrom.apply(x, group, tuple(sizes), dim) if group.world_size > 1 else x


def split_to(x: torch.Tensor, group: TPGroup, sizes: Sequence[int], dim: int) -> torch.Tensor:
    """Replicated to split: own slice forward, all-gather of the gradient backward."""
    return _SplitTo.apply(x, group, tuple(sizes), dim) if group.world_size > 1 else x


def gather_recurrent(
    x: torch.Tensor, group: TPGroup, sizes: Sequence[int], dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A split state gathered once, used twice: ``(for the next split step, replicated
    output)``; backward reduce-scatters the first's (partial) gradient and adds the own
    slice of the second's."""
    if group.world_size == 1:
        return x, x
    return _GatherRecurrent.apply(x, group, tuple(sizes), dim)
