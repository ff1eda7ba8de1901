"""Bytes each pipeline stage sends per training step: the activation at its output cut
forward and the gradient at its input cut backward, plus (last stage) the joined output to
the other stages (Huang et al., GPipe, 2019). Beside the algorithm it models, so that the
hybrid grid's model (:mod:`lightning_par.hybrid.cost`) and the compare tool
(:mod:`lightning_par.compare.costs`) read it from below."""

from __future__ import annotations

import torch
from torch import nn

from lightning_par.pipeline.partition import balance_by_params


def pipeline_bytes(net: nn.Sequential, stages: int, batch: torch.Tensor) -> list[int]:
    """Per stage: activations forward, their gradients backward, the output to all stages
    (balance by parameters, the strategies' default)."""
    balance = balance_by_params(net, stages)
    cuts, x, layer = [], batch, 0
    with torch.no_grad():
        for size in balance:
            for module in list(net)[layer : layer + size]:
                x = module(x)
            layer += size
            cuts.append(x.numel() * x.element_size())
    out = []
    for s in range(stages):
        sent = cuts[s] if s < stages - 1 else (stages - 1) * cuts[-1]
        out.append(sent + (cuts[s - 1] if s > 0 else 0))
    return out
