"""Flat units: parameters that share one flat buffer, cut into one equal shard per rank.

ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020, arXiv:1910.02054) gives every rank one ``1/p`` slice of the optimizer
state, the gradients and the parameters. As PyTorch FSDP's ``FlatParameter`` (Zhao et al.,
"PyTorch FSDP", VLDB 2023, section 3.2), a unit lays its parameters end to end in one flat
buffer padded to a multiple of ``p`` and rank ``r`` owns elements ``[r S, (r + 1) S)`` with
``S = ceil(n / p)``: the chunk ``r`` of the ring's two phases
(:func:`~lightning_par.collectives.ring_reduce_scatter`,
:func:`~lightning_par.collectives.ring_all_gather`).

Each parameter's ``data`` becomes a view of the flat buffer, so an all-gather into the
buffer is the model's new weights, and freeing the buffer's storage (stage 3) frees the
weights while every tensor keeps its shape: autograd's saved references to a weight see it
again once the buffer is gathered before backward (FSDP's ``resize_(0)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Piece:
    """The part of parameter ``index`` (of its unit) that falls in one rank's shard:
    elements ``[start, stop)`` of the flattened parameter, at ``shard_start`` in the shard."""

    index: int
    start: int
    stop: int
    shard_start: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


class FlatUnit:
    """``params`` (one dtype and device) laid end to end in :attr:`full`, rank ``rank`` of
    ``world_size`` owning :attr:`shard`.

    Args:
        index: the unit's position (buckets start in index order on every rank).
        params: the parameters, each listed once.
        world_size, rank: the ranks sharing the unit and this one.
    """

    def __init__(self, index: int, params: list[nn.Parameter], world_size: int, rank: int) -> None:
        first = params[0]
        self.index, self.params = index, params
        self.world_size, self.rank = world_size, rank
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.numel = sum(self.numels)
        self.shard_numel = -(-self.numel // world_size)
        self.padded_numel = self.shard_numel * world_size
        self.full = torch.zeros(self.padded_numel, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for p, start in zip(params, self.offsets):
                self.full[start : start + p.numel()].copy_(p.detach().reshape(-1))
                p.data = self.full[start : start + p.numel()].view_as(p)
        lo = rank * self.shard_numel
        #: this rank's shard: a view of :attr:`full` until :meth:`shard_at_rest` copies it
        self.shard = self.full[lo : lo + self.shard_numel]
        self.pieces = self.pieces_of(rank)
        self.gathered = True

    @property
    def dtype(self) -> torch.dtype:
        return self.full.dtype

    @property
    def device(self) -> torch.device:
        return self.full.device

    @property
    def element_size(self) -> int:
        return self.full.element_size()

    def pieces_of(self, rank: int) -> list[Piece]:
        """The parts of this unit's parameters that rank ``rank``'s shard holds."""
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        pieces = []
        for i, (start, n) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(lo, start), min(hi, start + n)
            if a < b:
                pieces.append(Piece(i, a - start, b - start, a - lo))
        return pieces

    # ---- stage 3: parameters sharded at rest ------------------------------------------------
    def shard_at_rest(self) -> None:
        """Keep only this rank's shard: copy it out of :attr:`full` and free the rest."""
        self.shard = self.shard.clone()
        self.free()

    def free(self) -> None:
        """Drop the gathered weights' storage (their shapes stay)."""
        if self.gathered:
            self.full.untyped_storage().resize_(0)
            self.gathered = False

    def allocate(self) -> torch.Tensor:
        """Give :attr:`full` its storage back, this rank's shard copied in; the caller
        all-gathers the rest. Returns :attr:`full`."""
        if not self.gathered:
            self.full.untyped_storage().resize_(self.padded_numel * self.element_size)
            lo = self.rank * self.shard_numel
            self.full[lo : lo + self.shard_numel].copy_(self.shard)
            self.gathered = True
        return self.full

    def restore_whole(self) -> None:
        """Give every parameter storage of its own again (the unit is no longer used)."""
        with torch.no_grad():
            for p, start, n in zip(self.params, self.offsets, self.numels):
                p.data = self.full[start : start + n].view_as(p).clone()

    # ---- gradients -------------------------------------------------------------------------
    def pack_gradients(self, scale: float) -> torch.Tensor:
        """The unit's gradients times ``scale`` as ``p`` rows of ``S + F``: row ``r`` holds
        shard ``r``'s gradients, then one flag per parameter (1: this rank has its
        gradient). Every row carries the flags, so after a reduce-scatter each rank knows,
        for every parameter, whether any rank had a gradient (None stays None, as in one
        process)."""
        p, s, f = self.world_size, self.shard_numel, len(self.params)
        rows = torch.zeros(p, s + f, dtype=self.dtype, device=self.device)
        flat = rows[:, :s]
        for i, param in enumerate(self.params):
            grad = param.grad
            if grad is None:
                continue
            rows[:, s + i] = 1
            values = grad.detach().reshape(-1)
            start, n = self.offsets[i], self.numels[i]
            for r in range(start // s, (start + n - 1) // s + 1):
                a, b = max(start, r * s), min(start + n, (r + 1) * s)
                torch.mul(values[a - start : b - start], scale, out=flat[r, a - r * s : b - r * s])
        return rows


def group_parameters(params: list[nn.Parameter], cap_bytes: int | None) -> list[list[nn.Parameter]]:
    """Consecutive ``params`` grouped by dtype and device, at most ``cap_bytes`` a group
    (a parameter larger than the cap is a group of its own; ``None``: no cap)."""
    groups: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        current = groups[-1] if groups else None
        fits = current is not None and (cap_bytes is None or size + nbytes <= cap_bytes)
        if fits and p.dtype == current[0].dtype and p.device == current[0].device:
            current.append(p)
            size += nbytes
        else:
            groups.append([p])
            size = nbytes
    return groups


def unit_parameters(model: nn.Module, stage: int, bucket_cap_mb: float) -> list[list[nn.Parameter]]:
    """The parameters of each unit at ``stage``: stage 3 one unit per module's own
    parameters (split by dtype: each layer gathered around its own forward), else the
    parameters in reverse order (as backward produces their gradients) grouped by dtype up to
    ``bucket_cap_mb``."""
    if stage == 3:
        groups, seen = [], set()
        for module in model.modules():
            own = [q for q in module.parameters(recurse=False) if id(q) not in seen]
            seen.update(id(q) for q in own)
            groups += group_parameters(own, None)
        return [g for g in groups if g]
    return group_parameters(list(reversed(list(model.parameters()))), int(bucket_cap_mb * 2**20))
