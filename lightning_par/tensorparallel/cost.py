"""The collectives one training step of a tensor-parallel model runs, from its plan and the
shapes one forward of the whole (unsplit) model sees: the input of
:func:`lightning_par.collectives.cost_model.tensor_parallel_cost`.

Per cut (Megatron-LM, Shoeybi et al., 2019, arXiv:1909.08053, figure 3):

* ``column`` / ``column_gather``: ``f``, an allreduce of the input's gradient, backward,
  when the input needs one (not for the network's first layer); ``column_gather`` also
  all-gathers its output forward;
* ``row``: ``g``, an allreduce of the output, forward;
* ``lstm``: ``f`` as for a column layer, then per time step an all-gather of the hidden
  state forward and, for all steps but the last, a reduce-scatter of its gradient backward.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from lightning_par.collectives.cost_model import Cost, tensor_parallel_cost
from lightning_par.tensorparallel.plan import Plan


def _numel_but(t: torch.Tensor, dim: int) -> int:
    return t.numel() // t.shape[dim]


def step_ops(module: nn.Module, plan: Plan, example_input: Any) -> list[tuple[str, Any]]:
    """``(kind, size)`` of every collective of one step (forward and backward) of ``module``
    split by ``plan``, for a batch like ``example_input`` (``module`` is not changed: a copy
    runs one forward)."""
    probe = copy.deepcopy(module)
    ops: list[tuple[str, Any]] = []
    handles = []

    def on_call(cut, layer):
        def hook(_mod, args, output):
            x = args[0]
            out = output[0] if isinstance(output, tuple) else output
            if cut.style in ("column", "column_gather", "lstm") and x.requires_grad:
                ops.append(("allreduce", x.numel()))
            if cut.style == "column_gather":
                dim = -1 if isinstance(layer, nn.Linear) else 1
                ops.append(("all_gather", (cut.sizes, _numel_but(out, dim))))
            elif cut.style == "row":
                ops.append(("allreduce", out.numel()))
            elif cut.style == "lstm":
                batch, steps = (x.shape[0], x.shape[1]) if layer.batch_first else x.shape[1::-1]
                ops.extend([("all_gather", (cut.sizes, batch))] * steps)
                ops.extend([("reduce_scatter", (cut.sizes, batch))] * (steps - 1))

        return hook

    for cut in plan.cuts:
        if cut.style != "norm":
            layer = probe.get_submodule(cut.name)
            handles.append(layer.register_forward_hook(on_call(cut, layer)))
    with torch.enable_grad():
        probe(example_input)
    for handle in handles:
        handle.remove()
    return ops


def step_cost(module: nn.Module, plan: Plan, example_input: Any, element_size: int = 4,
              algorithm: str = "ring") -> Cost:  # fmt: skip
    """Bytes and messages per rank of one training step (see :func:`step_ops`)."""
    ops = step_ops(module, plan, example_input)
    return tensor_parallel_cost(ops, plan.world_size, element_size, algorithm)
