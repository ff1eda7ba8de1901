"""Tensor parallelism at ``p`` ranks for the scale-out: the busiest rank's share of the model's
compute (:func:`busiest_share`) and the allreduces of a step (:func:`tp_allreduces`), from the
automatic plan the strategy makes at ``p``.

The share is weighed by FLOPs or, when the simulator predicts this machine, *measured here*.

FLOPs (:func:`~lightning_par.tensorparallel.cost.busiest_rank_share`) are the right weight for
a large layer on an accelerator, whose time follows its arithmetic. A small layer on a CPU
does not: here a 3x3 convolution with 16 output channels on a 32 x 32 map takes 16.4 ms
(fwd + bwd, batch 48, one thread) and the same with 8 output channels 15.3 ms, while halving
its *input* channels halves it (7.8 ms). So when the simulator predicts this machine (the
validation), it times each cut layer whole and as the busiest rank's slice, on the input the
layer sees, and weighs the model by those times (thread CPU time, best of several, one thread
as Lightning gives each rank here).
"""

from __future__ import annotations

import copy
import functools
import time
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from lightning_par.measure.run import make_model, sample_shape
from lightning_par.simulate.ops import NotApplicable
from lightning_par.simulate.profile import Profile
from lightning_par.simulate.timings import cached_from_here, timed
from lightning_par.tensorparallel.cost import busiest_rank_share, step_ops
from lightning_par.tensorparallel.plan import Plan, resolve_plan

REPEATS = 5


def _fwd_bwd_s(layer: nn.Module, x: torch.Tensor) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        x = x.detach().requires_grad_(True)
        start = time.thread_time()
        layer(x).sum().backward()
        best = min(best, time.thread_time() - start)
    return best


def _slice(layer: nn.Module, style: str, width: int) -> tuple[nn.Module, int] | None:
    """The busiest rank's piece of ``layer`` and the input channels it reads (``None``: a
    layer kind this module does not rebuild)."""
    if isinstance(layer, nn.Conv2d) and layer.groups == 1:
        cin, cout = (layer.in_channels, width) if style != "row" else (width, layer.out_channels)
        return nn.Conv2d(cin, cout, layer.kernel_size, layer.stride, layer.padding,
                         layer.dilation, bias=layer.bias is not None), cin  # fmt: skip
    if isinstance(layer, nn.Linear):
        fin, fout = (layer.in_features, width) if style != "row" else (width, layer.out_features)
        return nn.Linear(fin, fout, bias=layer.bias is not None), fin
    return None


def measured_busiest_share(module: nn.Module, plan: Plan, example_input: torch.Tensor) -> float:
    """The busiest rank's fwd + bwd time over the whole model's, on this machine: the model
    timed whole, minus each cut layer's time whole, plus its largest slice's time (a layer
    kind not rebuilt here counts its FLOP fraction of its own time)."""
    probe = copy.deepcopy(module)
    inputs: dict[str, torch.Tensor] = {}
    cuts = [cut for cut in plan.cuts if cut.style in ("column", "row", "column_gather")]

    def keep(name: str):
        def hook(_mod, args: Any) -> None:
            inputs[name] = args[0].detach()

        return hook

    handles = [probe.get_submodule(c.name).register_forward_pre_hook(keep(c.name)) for c in cuts]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            probe(example_input)
        for handle in handles:
            handle.remove()
        whole = _fwd_bwd_s(probe, example_input)
        saved = 0.0
        for cut in cuts:
            layer, x = probe.get_submodule(cut.name), inputs[cut.name]
            full = _fwd_bwd_s(layer, x)
            piece = _slice(layer, cut.style, max(cut.sizes))
            if piece is None:
                saved += full * (1 - max(cut.sizes) / sum(cut.sizes))
                continue
            part, reads = piece
            saved += full - _fwd_bwd_s(part, x[:, :reads] if x.shape[1] != reads else x)
    finally:
        torch.set_num_threads(threads)
    return max(whole - saved, 0.0) / whole if whole else 1.0


def _plan(model_name: str, p: int) -> tuple[nn.Module, torch.Tensor, Plan]:
    """The compare model, a two-sample example and the automatic plan at ``p`` ranks."""
    model = make_model(model_name)
    example = torch.zeros(2, *sample_shape(model))
    try:
        return model, example, resolve_plan(model, p, example_inputs=(example,))
    except ValueError as err:
        raise NotApplicable(f"{model_name} at {p} ranks: {err}") from err


@functools.cache
def busiest_share(model_name: str, p: int, measure_batch: int = 0) -> float:
    """The busiest rank's share of the compare model ``model_name`` under the automatic plan
    at ``p`` ranks: by FLOPs (:func:`~lightning_par.tensorparallel.cost.busiest_rank_share`),
    or, with ``measure_batch``, timed on this machine on a batch of that many images
    (:func:`measured_busiest_share`). :class:`~.ops.NotApplicable` where that plan cuts
    nothing: the strategy refuses such a run."""
    model, example, plan = _plan(model_name, p)
    if p > 1 and not any(cut.style != "norm" for cut in plan.cuts):
        raise NotApplicable(f"{model_name} has no layer the automatic plan cuts {p} ways")
    if measure_batch:
        batch = torch.randn(measure_batch, *example.shape[1:], generator=torch.Generator())
        key = f"busiest_share/{model_name}/{p}/{measure_batch}"
        return timed(key, lambda: measured_busiest_share(model, plan, batch))
    return busiest_rank_share(model, plan, example)


cached_from_here(busiest_share.cache_clear)


@functools.cache
def mean_over_busiest(model_name: str, p: int) -> float:
    """The mean rank's share of the model over the busiest rank's under the automatic plan
    at ``p`` (by FLOPs): below 1 where a cut is uneven (CifarCNN's second block at 3 ranks,
    16 | 8 | 8 channels), so the ranks together ask less of shared cores than ``p`` times
    the busiest one does."""
    model, example, plan = _plan(model_name, p)
    even = replace(plan, cuts=[replace(cut, sizes=(1,) * len(cut.sizes)) for cut in plan.cuts])
    busiest = busiest_rank_share(model, plan, example)
    return busiest_rank_share(model, even, example) / busiest if busiest else 1.0


def tp_allreduces(prof: Profile, p: int) -> list[int]:
    """Bytes of each allreduce of a tensor-parallel step at ``p`` ranks: those the automatic
    plan at ``p`` runs on the compare model (:func:`~lightning_par.tensorparallel.cost.
    step_ops`: a plan that cuts fewer layers at 3 ranks than at 2 runs fewer), else the
    measured count and size."""
    if not prof.model:
        return [prof.collective_bytes] * prof.collectives
    return list(_plan_allreduces(prof.model, p, prof.global_batch))


@functools.cache
def _plan_allreduces(model_name: str, p: int, batch: int) -> tuple[int, ...]:
    model, example, plan = _plan(model_name, p)
    inputs = torch.zeros(max(batch, 1), *example.shape[1:])
    return tuple(4 * size for kind, size in step_ops(model, plan, inputs) if kind == "allreduce")
