"""Choosing split points automatically, by parameter count or by measured time.

The candidates are :func:`~lightning_par.graphcut.cut.units` (the root's children with
containers opened: ResNet's blocks, a GPT's decoder layers); each unit's cost is its
parameter count (a parameter shared by several units counts once, where it is first used)
or its measured forward + backward time, and the exact linear partition of
:func:`lightning_par.split.balance_by_cost` groups consecutive units into
stages so that the costliest stage is as cheap as possible (GPipe's rule: the pipeline runs
at the pace of its slowest stage; Huang et al., 2019, section 2.2).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import fx, nn

from lightning_par.graphcut.cut import _belongs, units
from lightning_par.split import balance_by_cost

BALANCE_BY = ("parameters", "time")


def candidate_units(model: nn.Module, num_stages: int) -> list[str]:
    """:func:`units`, opening every module above half an even share of the parameters, so
    that no single unit keeps the balance far from even."""
    return units(model, open_above=sum(p.numel() for p in model.parameters()) // num_stages // 2)


def _units_in_order(model: nn.Module, traced: fx.GraphModule, num_stages: int) -> list[str]:
    """The units the forward pass calls, in the order it first reaches them."""
    nodes = list(traced.graph.nodes)
    first = {}
    for name in candidate_units(model, num_stages):
        # a unit inside a layer the trace calls whole (torch's TransformerEncoderLayer is a
        # leaf) never appears: cut at that layer instead
        parts = name.split(".")
        for unit in (".".join(parts[:k]) for k in range(len(parts), 0, -1)):
            found = next((i for i, n in enumerate(nodes) if _belongs(n, unit)), None)
            if found is not None:
                first.setdefault(unit, found)
                break
    return sorted(first, key=first.__getitem__)


def parameter_costs(model: nn.Module, names: Sequence[str]) -> list[float]:
    seen: set[int] = set()
    costs = []
    for name in names:
        params = [p for p in model.get_submodule(name).parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        costs.append(float(sum(p.numel() for p in params)))
    return costs


def time_costs(traced: fx.GraphModule, names: Sequence[str], inputs: Sequence, repeat: int = 3):
    """Seconds of each unit's forward operations, timed node by node while the traced graph
    runs (backward costs roughly twice the forward of the same operations, so the forward
    alone ranks the units; torchgpipe's ``balance_by_time`` times whole layers instead)."""
    spent = dict.fromkeys(names, 0.0)
    owner = {
        node: next((u for u in reversed(names) if _belongs(node, u)), names[0])
        for node in traced.graph.nodes
    }

    class Timed(fx.Interpreter):
        def run_node(self, n: fx.Node):
            start = time.perf_counter()
            result = super().run_node(n)
            spent[owner[n]] += time.perf_counter() - start
            return result

    with torch.no_grad():
        for _ in range(repeat):
            Timed(traced).run(*inputs)
    return [spent[n] / repeat for n in names]


def auto_split_points(
    model: nn.Module,
    traced: fx.GraphModule,
    num_stages: int,
    by: str = "parameters",
    inputs: Sequence | None = None,
) -> list[str]:
    """``num_stages - 1`` split points balancing ``by`` (``"parameters"`` or ``"time"``)."""
    if by not in BALANCE_BY:
        raise ValueError(f"balance by {by!r}: choose one of {BALANCE_BY}")
    names = _units_in_order(model, traced, num_stages)
    if len(names) < num_stages:
        raise ValueError(
            f"{type(model).__name__} has {len(names)} units to cut between ({names}), too few "
            f"for {num_stages} stages: use fewer devices or name split points inside a unit"
        )
    if by == "time":
        if inputs is None:
            raise ValueError("balancing by time needs example inputs to time the network on")
        costs = time_costs(traced, names, inputs)
    else:
        costs = parameter_costs(model, names)
    balance = balance_by_cost(costs, num_stages)
    points, start = [], 0
    for size in balance[:-1]:
        start += size
        points.append(names[start])
    return points
