"""The busiest tensor-parallel rank's share of the model's compute, *measured on this machine*.

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
import time
from typing import Any

import torch
from torch import nn

from lightning_par.tensorparallel.plan import Plan

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
