"""Bytes each pipeline stage of a cut network sends per training step: every tensor that
crosses its output cut forward, the gradients of the floating ones at its input cut back,
and (last stage) the joined output to every other stage. The ``nn.Sequential`` case, one
activation per cut, is :func:`lightning_par.pipeline.cost.pipeline_bytes`."""

from __future__ import annotations

import torch
from torch import nn

from lightning_par.graphcut import split_module
from lightning_par.graphcut.cut import GraphSplit


def _nbytes(values: tuple, floating_only: bool = False) -> int:
    return sum(
        t.numel() * t.element_size()
        for t in values
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or not floating_only)
    )


def split_bytes(split: GraphSplit, *batch: torch.Tensor) -> list[int]:
    """Per stage of ``split``, run on ``batch`` (the whole step's samples: the micro-batches'
    messages add up to the batch's): activations sent forward plus gradients sent back."""
    forward, backward, values = [], [], batch
    with torch.no_grad():
        for stage in split.stages[:-1]:
            values = stage.module(*values)
            values = values if isinstance(values, tuple) else (values,)
            forward.append(_nbytes(values))
            backward.append(_nbytes(values, floating_only=True))
        out = split.stages[-1].module(*values)
    last = len(split) - 1
    sent = []
    for s in range(len(split)):
        own = forward[s] if s < last else last * _nbytes(out if isinstance(out, tuple) else (out,))
        sent.append(own + (backward[s - 1] if s > 0 else 0))
    return sent


def network_bytes(net: nn.Module, stages: int, batch: torch.Tensor) -> list[int]:
    """:func:`split_bytes` of ``net`` cut as the pipeline strategies cut it by default (by
    parameter count)."""
    return split_bytes(split_module(net, (batch,), num_stages=stages), batch)
