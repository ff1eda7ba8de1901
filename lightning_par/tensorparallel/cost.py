"""What one training step of a tensor-parallel model sends: the collectives it runs, from its
plan and the shapes one forward of the whole (unsplit) model sees (:func:`step_ops`), and
their cost in the alpha-beta model of :mod:`lightning_par.collectives.cost_model`
(:func:`tensor_parallel_cost`). The ring all-gather and reduce-scatter of unequal slices
``s[k]``: rank ``r`` sends ``S - s[(r+1)%p]`` and ``S - s[r]`` elements, ``S`` the sum.

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
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_par.collectives.cost_model import Cost, predict, zero_cost
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


def busiest_rank_share(module: nn.Module, plan: Plan, example_input: Any) -> float:
    """The share of one process's forward FLOPs that the busiest rank computes under ``plan``:
    each cut layer's FLOPs times its largest slice (``max(sizes) / sum(sizes)``: a plan may
    cut unevenly, e.g. GroupNorm's whole groups), every layer left whole in full. Backward
    costs about twice the forward in each weight layer (Kaplan et al., 2020, arXiv:2001.08361,
    section 2.1), so the share holds for a training step's compute. FLOPs are counted by
    torch's ``FlopCounterMode`` on one forward of a copy of ``module``."""
    from torch.utils.flop_counter import FlopCounterMode  # torch's counter, only needed here

    probe = copy.deepcopy(module)
    counter = FlopCounterMode(display=False)
    cut_flops: dict[str, list[int]] = {}

    def watch(name: str):
        def before(_mod, _args):
            cut_flops.setdefault(name, []).append(-counter.get_total_flops())

        def after(_mod, _args, _out):
            cut_flops[name][-1] += counter.get_total_flops()

        return before, after

    handles = []
    for cut in plan.cuts:
        if cut.style != "norm":
            before, after = watch(cut.name)
            layer = probe.get_submodule(cut.name)
            handles += [layer.register_forward_pre_hook(before), layer.register_forward_hook(after)]
    with torch.no_grad(), counter:
        probe(example_input)
    for handle in handles:
        handle.remove()
    total = counter.get_total_flops()
    if not total:
        return 1.0
    saved = sum(sum(cut_flops.get(cut.name, [0])) * (1 - max(cut.sizes) / sum(cut.sizes))
                for cut in plan.cuts if cut.style != "norm" and sum(cut.sizes))  # fmt: skip
    return max(total - saved, 0) / total


def all_gather_cost(sizes: Sequence[int], rest: int = 1, element_size: int = 4) -> Cost:
    """The ring all-gather of :func:`lightning_par.tensorparallel.all_gather`: rank ``r``'s
    slice is ``sizes[r] * rest`` elements; rank ``r`` sends every slice but its right
    neighbour's, ``p - 1`` messages (empty ones are not sent)."""
    p, total = len(sizes), sum(sizes) * rest
    if p == 1 or total == 0:
        return zero_cost("all_gather", total, p, element_size)
    sent = [(r - s) % p for r in range(p) for s in range(p - 1)]
    return _ring_pass("all_gather", sizes, rest, element_size, sent)


def reduce_scatter_cost(sizes: Sequence[int], rest: int = 1, element_size: int = 4) -> Cost:
    """The ring reduce-scatter of :func:`lightning_par.tensorparallel.reduce_scatter`: rank
    ``r`` ends with slice ``r`` of the sum and sends every slice but its own."""
    p, total = len(sizes), sum(sizes) * rest
    if p == 1 or total == 0:
        return zero_cost("reduce_scatter", total, p, element_size)
    sent = [(r - s - 1) % p for r in range(p) for s in range(p - 1)]
    return _ring_pass("reduce_scatter", sizes, rest, element_size, sent)


def _ring_pass(name: str, sizes: Sequence[int], rest: int, element_size: int,
               sent: list[int]) -> Cost:  # fmt: skip
    """``sent``: the slice each rank sends at each of the ``p - 1`` steps, rank by rank."""
    p = len(sizes)
    per_rank = [sent[r * (p - 1) : (r + 1) * (p - 1)] for r in range(p)]
    nbytes = tuple(sum(sizes[k] for k in ks) * rest * element_size for ks in per_rank)
    messages = tuple(sum(1 for k in ks if sizes[k]) for ks in per_rank)
    steps = p - 1
    return Cost(name, p, sum(sizes) * rest, element_size, nbytes, messages, steps, float(steps),
                float(steps * max(sizes) * rest * element_size))  # fmt: skip


def tensor_parallel_cost(
    ops: Iterable[tuple[str, Any]], world_size: int, element_size: int = 4,
    algorithm: str = "ring",
) -> Cost:  # fmt: skip
    """The sum of a tensor-parallel step's collectives. ``ops``: ``("allreduce", numel)`` (an
    ``f`` or ``g`` of ``algorithm``), ``("all_gather", (sizes, rest))`` or
    ``("reduce_scatter", (sizes, rest))``, as :func:`step_ops` lists them for a model
    (Megatron's MLP block: one allreduce of the block's output forward, one of its input
    gradient backward)."""
    costs = []
    for kind, arg in ops:
        if kind == "allreduce":
            costs.append(predict(algorithm, arg, world_size, element_size))
        elif kind in ("all_gather", "reduce_scatter"):
            sizes, rest = arg
            if len(sizes) != world_size:
                raise ValueError(f"{kind} of {len(sizes)} slices on {world_size} ranks")
            fn = all_gather_cost if kind == "all_gather" else reduce_scatter_cost
            costs.append(fn(sizes, rest, element_size))
        else:
            raise ValueError(f"unknown tensor-parallel op {kind!r}")
    p = world_size
    return Cost(
        "tensor_parallel", p, sum(c.numel for c in costs), element_size,
        tuple(sum(c.bytes_sent[r] for c in costs) for r in range(p)),
        tuple(sum(c.messages_sent[r] for c in costs) for r in range(p)),
        sum(c.steps for c in costs), sum(c.latency_terms for c in costs),
        sum(c.bandwidth_bytes for c in costs),
    )  # fmt: skip
