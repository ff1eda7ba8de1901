"""Bytes a stage holds: parameters, their gradients, the optimiser's state and the
activations saved for backward. Layer-wise parallelism exists to cut these per device to
about 1/K of the model (slides 004: "a set of layers or a layer can have a specific device").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from lightning_par.pipeline.partition import split_sequential


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def predicted_param_bytes(net: nn.Sequential, balance: Sequence[int]) -> list[int]:
    """Parameter bytes of each stage of ``net`` cut by ``balance`` (no process needed)."""
    return [tensor_bytes(stage.parameters()) for stage in split_sequential(net, balance)]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of every tensor in the optimiser's per-parameter state (momentum, Adam moments,
    step counters)."""
    if optimizer is None:
        return 0
    return sum(
        tensor_bytes(v for v in state.values() if isinstance(v, torch.Tensor))
        for state in optimizer.state.values()
    )


def stage_memory(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    activation_bytes: int | None = None,
) -> dict[str, int]:
    """What one stage holds now: ``param_bytes``, ``grad_bytes`` (gradients present),
    ``optimizer_bytes`` and ``activation_bytes`` (peak saved for backward in a step, when
    measured)."""
    params = list(module.parameters())
    return {
        "param_bytes": tensor_bytes(params),
        "grad_bytes": tensor_bytes(p.grad for p in params if p.grad is not None),
        "optimizer_bytes": optimizer_state_bytes(optimizer),
        "activation_bytes": int(activation_bytes or 0),
    }
