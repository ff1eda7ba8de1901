"""Column -> row pairs found in a network's traced graph, for layers outside an
``nn.Sequential`` (a ResNet block's ``conv1 -> bn1 -> relu -> conv2`` lives in its
``forward``, not in a container the plan can read).

A weight layer pairs with the next one of its kind when its output reaches that layer and
nothing else, through per-channel norms, dropout and elementwise activations only (modules
or functions); the plan then splits the first by output channels and the second by input
channels, as for a pair inside an ``nn.Sequential`` (Megatron's MLP block, Shoeybi et al.,
2019, arXiv:1909.08053). The trace is :mod:`lightning_par.graphcut`'s, on one example batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import fx, nn

from lightning_par.graphcut import trace
from lightning_par.tensorparallel.blocks import ELEMENTWISE_FUNCTIONS
from lightning_par.tensorparallel.cuts import ELEMENTWISE, NORMS, WEIGHT_LAYERS

#: Activations written as calls rather than modules.
FUNCTIONS = (*ELEMENTWISE_FUNCTIONS, torch.relu, torch.tanh, torch.sigmoid)


def _next(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def traced_pairs(net: nn.Module, example_inputs: Sequence) -> dict[str, tuple[list[str], str]]:
    """``{column layer: (modules between, row layer)}`` by names relative to ``net``."""
    graph = trace(net, example_inputs).graph
    modules = dict(net.named_modules())
    pairs: dict[str, tuple[list[str], str]] = {}
    for node in graph.nodes:
        first = modules.get(node.target) if node.op == "call_module" else None
        if not isinstance(first, WEIGHT_LAYERS):
            continue
        between: list[str] = []
        current = _next(node)
        while current is not None:
            if current.op == "call_module":
                layer = modules.get(current.target)
                if type(layer) is type(first):
                    pairs[node.target] = (between, current.target)
                    break
                if not isinstance(layer, ELEMENTWISE + NORMS + (nn.Dropout,)):
                    break
                between.append(current.target)
            elif current.op != "call_function" or current.target not in FUNCTIONS:
                break
            current = _next(current)
    return pairs
