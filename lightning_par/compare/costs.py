"""Bytes each rank should send per training step, from each plugin's own cost model.

=======================  =====================================================================
strategy                 bytes sent by rank ``r`` per step (``n``: gradient elements)
=======================  =====================================================================
``<algo>_allreduce``     :func:`~lightning_par.collectives.cost_model.predict` of each gradient
                         bucket (its ``n_b`` gradients plus one flag per parameter), summed
``local_sgd``            the ring allreduce of every parameter and floating buffer, once per
                         ``period`` steps (so divided by ``period``)
``gpipe``/``layerwise``  stage ``s`` of ``K``: the activation at its output cut forward and
                         the gradient at its input cut backward, ``B`` samples each, plus (last
                         stage) the joined output to the ``K - 1`` others (Huang et al. 2019)
``parameter_server``,    a worker pushes its whole gradient, ``4n`` bytes (Li et al. 2014);
``async_sgd``            the per-piece flags and control headers come on top (a few bytes)
=======================  =====================================================================

A strategy not listed here has no model in the compare, unless its class offers one: a
``compare_bytes_per_step(model, devices, global_batch, options) -> list[int]`` class method
(per rank). The repor    says "no model" rather than guess.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_par.collectives.averaging import averaged_tensors
from lightning_par.collectives.cost_model import bucketed_allreduce_bytes as allreduce_bytes
from lightning_par.collectives.cost_model import predict
from lightning_par.graphcut.cost import network_bytes
from lightning_par.pipeline.cost import pipeline_bytes

#: Why a strategy has no byte model (shown in the report).
NO_MODEL = {
    "lightning_ddp": "torch DDP's allreduce runs inside gloo/NCCL, outside lightning_par's "
    "traced communicator: neither measured nor modelled",
}


def local_sgd_bytes(model: nn.Module, world: int, period: int, algorithm: str = "ring") -> list:
    """Per rank and step: one allreduce of the averaged tensors every ``period`` steps."""

    numel = sum(t.numel() for t in averaged_tensors(model, buffers=True))
    return [b / period for b in predict(algorithm, numel, world).bytes_sent]


def predicted_bytes(
    name: str,
    options: dict[str, Any],
    strategy_cls: type,
    model: Any,
    devices: int,
    global_batch: int,
) -> tuple[list[float] | None, str]:
    """(bytes per rank per step or ``None``, what the model counts)."""
    own = getattr(strategy_cls, "compare_bytes_per_step", None)
    if own is not None:
        try:
            return list(own(model, devices, global_batch, options)), "the strategy's own model"
        except ValueError as error:  # e.g. no byte model for this network
            return None, str(error)
    if name in NO_MODEL:
        return None, NO_MODEL[name]
    if name.endswith("_allreduce") and "algorithm" in options:
        cap = options.get("bucket_cap_mb", 4.0)
        return allreduce_bytes(model, options["algorithm"], devices, cap), (
            f"cost_model.predict('{options['algorithm']}') per gradient bucket"
        )
    if name == "local_sgd":
        period = options.get("period", 4)
        if period is None:
            return None, "local_sgd averages once per epoch: no per-step model"
        algo = options.get("algorithm", "ring")
        return local_sgd_bytes(model, devices, period, algo), (
            f"cost_model.predict('{algo}') of all parameters / period {period}"
        )
    if name in ("gpipe", "layerwise") and options.get("time_chunk") is None:
        sample = torch.zeros(global_batch, 3, 32, 32)
        net = model.net
        sent = (
            pipeline_bytes(net, devices, sample)
            if isinstance(net, nn.Sequential)
            else network_bytes(net, devices, sample)
        )
        return sent, "activations and gradients at the stage cuts, output to every stage"
    if name in ("parameter_server", "async_sgd"):
        n = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        return [n] * devices, "the gradient pushed per worker (flags, headers excluded)"
    return None, "no cost model for this strategy in the compare"
