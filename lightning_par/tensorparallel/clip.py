"""Clipping by the whole model's gradient norm when the model is split across ranks.

``torch.nn.utils.clip_grad_norm_`` on one rank would see only that rank's slices (Megatron-LM,
Shoeybi et al., 2019, arXiv:1909.08053, computes the norm the same way: split parameters'
squares summed over the ranks, replicated ones counted once)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lightning_par.tensorparallel.mappings import TPGroup


def clip_grad_norm_split(
    split: Iterable[torch.Tensor],
    replicated: Iterable[torch.Tensor],
    max_norm: float,
    group: TPGroup,
) -> torch.Tensor:
    """Scale every gradient by ``clip_grad_norm_``'s coefficient for the full model's norm.

    ``split``: this rank's slices (their squares are summed over ``group``); ``replicated``:
    parameters every rank holds whole (counted once, on rank 0). Every rank of ``group`` must
    call this; the allreduce leaves the same bits everywhere, so replicated parameters stay
    identical. Returns the total norm."""
    mine = [p.grad for p in split if p.grad is not None]
    whole = [p.grad for p in replicated if p.grad is not None]
    counted = mine + (whole if group.rank == 0 else [])
    device = (mine or whole or [torch.zeros(())])[0].device
    squares = torch.zeros(1, dtype=torch.float32, device=device)
    for g in counted:
        squares += torch.linalg.vector_norm(g.detach().float(), 2) ** 2
    total = group.allreduce(squares, "tp:clip").sqrt()[0]
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # clip_grad_norm_'s formula
    for g in mine + whole:
        g.detach().mul_(coef.to(g.dtype))
    return total


__all__ = ["clip_grad_norm_split"]
