"""Cutting any network into pipeline stages (no Lightning, no processes).

* :mod:`.tracer`: the network as a ``torch.fx`` graph over its own modules, with the shapes
  of one example input (why fx and not ``torch.export``: see there);
* :mod:`.cut`: stages cut before named modules, the tensors that cross each cut, the
  parameters that several stages share (tied weights);
* :mod:`.auto`: split points chosen by parameter count or measured time.

:func:`split_module` is the whole path: ``split_module(resnet, (images,), ["layer3"])``
gives two stages whose chain computes ``resnet(images)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_par.graphcut.auto import BALANCE_BY, auto_split_points
from lightning_par.graphcut.cut import GraphSplit, Stage, cut, run_chain, units
from lightning_par.graphcut.tracer import ShapeTracer, UnsplittableModel, trace


def split_module(
    model: nn.Module,
    example_inputs: Sequence,
    split_points: Sequence[str] | None = None,
    *,
    num_stages: int | None = None,
    balance_by: str = "parameters",
    leaf_modules: Sequence[str] = (),
) -> GraphSplit:
    """``model`` cut into stages before ``split_points`` (module names), or into
    ``num_stages`` stages chosen by ``balance_by`` when no split points are given."""
    traced = trace(model, example_inputs, leaf_modules)
    if split_points is None:
        if num_stages is None:
            raise ValueError("give split_points (module names) or num_stages")
        split_points = auto_split_points(model, traced, num_stages, balance_by, example_inputs)
    elif num_stages is not None and len(split_points) + 1 != num_stages:
        raise ValueError(
            f"{len(split_points)} split points make {len(split_points) + 1} stages, "
            f"not {num_stages}: give one split point fewer than stages"
        )
    return cut(traced, list(split_points))


__all__ = [
    "BALANCE_BY",
    "GraphSplit",
    "ShapeTracer",
    "Stage",
    "UnsplittableModel",
    "auto_split_points",
    "cut",
    "run_chain",
    "split_module",
    "trace",
    "units",
]
