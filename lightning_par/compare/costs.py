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
``tensor_parallel``      the ``f``/``g`` allreduces of the automatic (or given) plan on the
                         global batch (:func:`lightning_par.tensorparallel.cost.step_cost`;
                         Shoeybi et al. 2019)
``hybrid``               a pipelined ``mp_kind``'s cuts on its row plus the allreduce of its
                         stage's gradient buckets over its column
                         (:func:`lightning_par.hybrid.cost.hybrid_bytes_per_step`)
``zero``                 the ring phases on ZeRO's flat units (:func:`zero_bytes`; Rajbhandari
                         et al. 2020): stage 1 the ring allreduce of the gradient buckets
                         plus one all-gather of every unit, ``3(p-1)/p Ψ``; stage 2 a
                         reduce-scatter and an all-gather of every unit, ``2(p-1)/p Ψ``;
                         stage 3 a reduce-scatter and two all-gathers, ``3(p-1)/p Ψ``
=======================  =====================================================================

The inputs are zeros shaped as the model's (:func:`~lightning_par.measure.run.sample_shape`).
A strategy not listed here has no model in the compare, unless its class offers one: a
``compare_bytes_per_step(model, devices, global_batch, options) -> list[int]`` class method
(per rank). The report says "no model" rather than guess.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn

from lightning_par.collectives.averaging import averaged_tensors
from lightning_par.collectives.cost_model import bucketed_allreduce_bytes as allreduce_bytes
from lightning_par.collectives.cost_model import predict
from lightning_par.components.hybrid_kinds import DEFAULT_KIND
from lightning_par.components.splitter import find_network
from lightning_par.graphcut.cost import network_bytes
from lightning_par.hybrid.cost import hybrid_bytes_per_step
from lightning_par.hybrid.grid import make_grid
from lightning_par.measure.run import sample_shape
from lightning_par.pipeline.cost import pipeline_bytes
from lightning_par.tensorparallel import resolve_plan
from lightning_par.tensorparallel.cost import all_gather_cost, reduce_scatter_cost, step_cost
from lightning_par.zero.units import group_parameters

#: Why a strategy has no byte model (shown in the report).
NO_MODEL = {
    "lightning_ddp": "torch DDP's allreduce runs inside gloo/NCCL, outside lightning_par's "
    "traced communicator: neither measured nor modelled",
}


def local_sgd_bytes(model: nn.Module, world: int, period: int, algorithm: str = "ring") -> list:
    """Per rank and step: one allreduce of the averaged tensors every ``period`` steps."""

    numel = sum(t.numel() for t in averaged_tensors(model, buffers=True))
    return [b / period for b in predict(algorithm, numel, world).bytes_sent]


def tensor_parallel_bytes(model: Any, devices: int, global_batch: int,
                          options: dict[str, Any]) -> list[int]:  # fmt: skip
    """Per rank and step: the plan's ``f``/``g`` allreduces on the whole global batch (every
    rank of ``tensor_parallel`` reads all of it)."""
    attr = find_network(model, options.get("module_attr"), "tensor_parallel")
    sample = torch.zeros(global_batch, *sample_shape(model))
    plan = resolve_plan(model, devices, options.get("plan"), attr, (sample[:2],))
    algorithm = options.get("algorithm", "ring")
    return list(step_cost(model, plan, sample, algorithm=algorithm).bytes_sent)


def hybrid_bytes(model: Any, devices: int, global_batch: int, options: dict[str, Any]) -> list[int]:
    """Per rank and step, for the pipelined kinds of ``hybrid`` (``gpipe``, or ``layerwise``
    without ``time_chunk``); ``ValueError`` for the others."""
    kind = options.get("mp_kind", DEFAULT_KIND)
    if kind not in ("gpipe", "layerwise") or options.get("time_chunk") is not None:
        raise ValueError(f"hybrid: no byte model for mp_kind={kind!r} with these options")
    grid = make_grid(devices, options.get("dp"), options.get("mp"))
    return hybrid_bytes_per_step(
        getattr(model, find_network(model, options.get("module_attr"), "hybrid")), grid,
        global_batch, dp_algorithm=options.get("dp_algorithm", "ring"),
        bucket_cap_mb=options.get("bucket_cap_mb", 4.0), sample_shape=sample_shape(model),
    )  # fmt: skip


def zero_bytes(model: Any, devices: int, global_batch: int, options: dict[str, Any]) -> list[int]:
    """Per rank and step, the collectives that ``ZeroShards`` runs on the units it lays out
    (:mod:`lightning_par.components.zero_shards`): stage 1 the ``ring_allreduce`` of the gradient
    buckets; stages 2-3 a ring reduce-scatter of each unit holding a trainable parameter (its
    ``p`` rows of ``S`` gradients and one flag per parameter); stages 1-2 one ring all-gather
    of each such unit's ``p S`` weights after the step; stage 3 one all-gather of a layer's
    unit per forward call and one before its backward (a unit no layer's forward covers: one
    per step), found by a forward pass on a sample as the strategy's first step finds it."""
    stage, p = int(options.get("stage", 3)), devices
    cap_mb = float(options.get("bucket_cap_mb", 4.0))
    if stage == 3:
        units = _stage3_units(model, torch.zeros(2, *sample_shape(model)))
    else:
        params = list(reversed(list(model.parameters())))
        units = [(g, 1) for g in group_parameters(params, int(cap_mb * 2**20))]
    total = allreduce_bytes(model, "ring", p, cap_mb) if stage == 1 else [0] * p
    for group, gathers in units:
        shard, size = -(-sum(q.numel() for q in group) // p), group[0].element_size()
        trainable = any(q.requires_grad for q in group)
        sent = [0] * p
        if trainable or stage == 3:
            sent = [b * gathers for b in all_gather_cost([shard] * p, 1, size).bytes_sent]
        if trainable and stage > 1:
            scatter = reduce_scatter_cost([shard + len(group)] * p, 1, size).bytes_sent
            sent = [a + b for a, b in zip(sent, scatter)]
        total = [a + b for a, b in zip(total, sent)]
    return total


def _stage3_units(model: nn.Module, sample: torch.Tensor) -> list[tuple[list, int]]:
    """Stage 3's units (each module's own parameters) and the all-gathers of each per step:
    the forward calls of the deepest module that ran and holds it, plus one before its
    backward where that module's output needs a gradient; one for a unit that no module
    below the root covers (gathered for the whole step)."""
    calls: Counter = Counter()
    needs_grad: set[nn.Module] = set()

    def seen(module: nn.Module, args: Any, output: Any) -> None:
        calls[module] += 1
        if isinstance(output, torch.Tensor) and output.requires_grad:
            needs_grad.add(module)
        elif isinstance(output, (tuple, list)):
            if any(isinstance(t, torch.Tensor) and t.requires_grad for t in output):
                needs_grad.add(module)

    hooks = [m.register_forward_hook(seen) for m in model.modules()]
    try:
        model(sample)
    finally:
        for hook in hooks:
            hook.remove()
    parent = {child: m for m in model.modules() for child in m.children()}
    done: set[int] = set()
    units = []
    for module in model.modules():
        own = [q for q in module.parameters(recurse=False) if id(q) not in done]
        done.update(id(q) for q in own)
        trigger = module
        while trigger is not None and trigger not in calls:
            trigger = parent.get(trigger)
        resident = trigger is None or trigger is model
        gathers = 1 if resident else calls[trigger] + (trigger in needs_grad)
        units += [(group, gathers) for group in group_parameters(own, None)]
    return units


#: The models of strategies whose bytes depend on how their kind splits or lays out the
#: model.
SPLIT_MODELS = {
    "tensor_parallel": (tensor_parallel_bytes, "the f/g allreduces of the tensor-parallel plan"),
    "hybrid": (
        hybrid_bytes,
        "the stage cuts of each row plus each stage's allreduce over its column",
    ),
    "zero": (zero_bytes, "ring phases on the flat units (stage 1: + the gradient buckets' ring)"),
}


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
    model_of, note = SPLIT_MODELS.get(name, (own, "the strategy's own model"))
    if model_of is not None:
        try:
            return list(model_of(model, devices, global_batch, options)), note
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
        sample = torch.zeros(global_batch, *sample_shape(model))
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
