"""Cutting a traced network into consecutive stages at module boundaries.

A split point names a module; the cut falls *before* the first operation of that module in
execution order (torch's ``SplitPoint.BEGINNING``). Everything the graph computes before
the first cut is stage 0, and so on. A value computed in one stage and used in a later one
*crosses* every cut in between: stage ``s`` receives the values crossing the cut before it
and sends those crossing the cut after it, its own results and the ones it only passes on
(a residual skip over a whole stage travels through it). So the stages form a chain, each
``forward(*received) -> tuple(sent)``, and the last returns the network's own output.

Parameters are not values that cross: a stage reads the parameters it uses itself. A
parameter used by more than one stage (an embedding tied to the output layer, a module
called in two places) is *shared*: every stage that uses it holds it, and its gradient is
the sum of theirs (DeepSpeed's ``TiedLayerSpec``: one allreduce of the tied gradients
among the stages holding them keeps the copies equal).

Each stage is an ``fx.GraphModule`` over the user's own module objects, so its parameter
names are the network's (``layer1.0.conv1.weight``) and its state dict merges back into
the network's.

A value that crosses a cut, a network input or the network's output may be a tuple or list
(nested) of tensors (an LSTM's ``(h, c)``): it travels as its tensors and is rebuilt on the
receiving side (:mod:`.nested`), so every stage maps tensors to tensors; the last stage
returns the output's tensors, which :attr:`GraphSplit.output_structure` rebuilds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from lightning_par.graphcut import nested
from lightning_par.graphcut.tracer import UnsplittableModel


@dataclass(frozen=True)
class Stage:
    """One stage of a cut network: ``module(*inputs)`` returns the values named ``outputs``
    (the network's output for the last stage)."""

    index: int
    module: fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    @property
    def parameter_names(self) -> list[str]:
        return [name for name, _ in self.module.named_parameters()]


@dataclass(frozen=True)
class GraphSplit:
    """The stages of a network and the parameters that more than one of them uses."""

    stages: list[Stage]
    #: parameter name (as the first stage using it calls it) -> indices of the stages using it
    shared: dict[str, tuple[int, ...]] = field(default_factory=dict)

    #: each network input's structure (``None``: a tensor; stage 0 takes their tensors)
    input_structures: tuple[nested.Structure, ...] = ()
    #: the network output's structure (the last stage returns its tensors)
    output_structure: nested.Structure = None

    def __len__(self) -> int:
        return len(self.stages)


def _module_paths(node: fx.Node) -> list[str]:
    paths = list(node.meta.get("nn_module_stack", {}))
    if node.op == "call_module":
        paths.append(str(node.target))
    return paths


def _belongs(node: fx.Node, name: str) -> bool:
    return any(p == name or p.startswith(name + ".") for p in _module_paths(node))


def cut_positions(graph: fx.Graph, split_points: Sequence[str]) -> list[int]:
    """The index (in ``graph.nodes``) of the first operation of each split point's module."""
    nodes = list(graph.nodes)
    positions = []
    for name in split_points:
        found = next((i for i, n in enumerate(nodes) if _belongs(n, name)), None)
        if found is None:
            raise ValueError(
                f"split point {name!r} is not a module the network's forward calls; "
                "give module names as in named_modules(), e.g. 'layer3'"
            )
        positions.append(found)
    for (a, pa), (b, pb) in zip(zip(split_points, positions), zip(split_points[1:], positions[1:])):
        if pb <= pa:
            raise ValueError(
                f"split point {b!r} runs before or with {a!r}: list split points in the order "
                "the forward pass reaches them, one module per cut"
            )
    return positions


def _stage_of_nodes(graph: fx.Graph, positions: Sequence[int]) -> dict[fx.Node, int]:
    stage_of, stage = {}, 0
    for i, node in enumerate(graph.nodes):
        while stage < len(positions) and i >= positions[stage]:
            stage += 1
        if node.op == "placeholder":
            stage_of[node] = 0
        elif node.op == "output":
            stage_of[node] = len(positions)
        elif node.op != "get_attr":  # attributes are read where they are used
            stage_of[node] = stage
    return stage_of


def _crossing(stage_of: dict[fx.Node, int], num_stages: int) -> list[list[fx.Node]]:
    """``crossing[c]``: the values computed at or before stage ``c`` and used after it."""
    crossing: list[list[fx.Node]] = [[] for _ in range(num_stages - 1)]
    for node, stage in stage_of.items():
        last_use = max((stage_of[u] for u in node.users if u in stage_of), default=stage)
        for cut in range(stage, last_use):
            crossing[cut].append(node)
    for cut, values in enumerate(crossing):
        for node in values:
            example = node.meta.get("example")
            if not nested.travels(example):
                raise UnsplittableModel(
                    f"the value {node.name!r} ({nested.describe(example)}, from "
                    f"{node.format_node()}) would cross the cut after stage {cut}: only "
                    "tensors (and tuples/lists of tensors) travel between stages. "
                    "Move that split point to a module boundary where only tensors are live"
                )
    return crossing


def _build_stage(
    root: fx.GraphModule,
    index: int,
    nodes: list[fx.Node],
    inputs: list[fx.Node],
    outputs: list[fx.Node] | None,
    network_output: fx.Node | None,
) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:  # a container arrives as its tensors and is packed again
        example = node.meta.get("example")
        if isinstance(example, torch.Tensor) or not nested.travels(example):
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
            continue
        leaves, structure = nested.flatten(example)
        names = [graph.placeholder(f"{node.name}_{j}") for j in range(len(leaves))]
        for placeholder, leaf in zip(names, leaves):
            placeholder.meta["example"] = leaf
        env[node] = nested.rebuild_node(graph, structure, iter(names))
        env[node].meta["example"] = example

    def lookup(arg: fx.Node) -> fx.Node:
        if arg not in env and arg.op == "get_attr":  # each stage reads its own parameters
            env[arg] = graph.node_copy(arg)
        return env[arg]

    for node in nodes:
        env[node] = graph.node_copy(node, lookup)
    if network_output is not None:
        value = fx.node.map_arg(network_output.args[0], lookup)
        leaves = _output_leaves(graph, value)
        one = isinstance(value, fx.Node) and isinstance(value.meta.get("example"), torch.Tensor)
        graph.output(leaves[0] if one else tuple(leaves))
    else:
        sent = [nested.leaf_nodes(graph, env[n], n.meta.get("example")) for n in outputs or []]
        graph.output(tuple(leaf for leaves in sent for leaf in leaves))
    graph.lint()
    return fx.GraphModule(root, graph, f"Stage{index}")


def _example(value: Any) -> Any:
    """The example value of ``value``, a (container of) node(s) of a traced graph."""
    return fx.node.map_aggregate(
        value, lambda v: v.meta.get("example") if isinstance(v, fx.Node) else v
    )


def _output_leaves(graph: fx.Graph, value: Any) -> list[fx.Node]:
    """The nodes of each tensor of the network's output ``value`` (nodes in containers)."""
    if isinstance(value, fx.Node):
        return nested.leaf_nodes(graph, value, value.meta.get("example"))
    if type(value) in (tuple, list):
        return [leaf for item in value for leaf in _output_leaves(graph, item)]
    raise UnsplittableModel(
        f"the network returns {nested.describe(_example(value))}: a pipeline's last stage "
        "sends tensors (or tuples/lists of tensors) only"
    )


def _parameters_used(stage: fx.GraphModule) -> dict[int, str]:
    return {id(p): name for name, p in stage.named_parameters(remove_duplicate=False)}


def cut(traced: fx.GraphModule, split_points: Sequence[str]) -> GraphSplit:
    """Cut ``traced`` (from :func:`lightning_par.graphcut.tracer.trace`) before each split
    point's module into ``len(split_points) + 1`` stages."""
    graph = traced.graph
    positions = cut_positions(graph, split_points)
    stage_of = _stage_of_nodes(graph, positions)
    num_stages = len(positions) + 1
    crossing = _crossing(stage_of, num_stages)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    stages = []
    for s in range(num_stages):
        own = [n for n in graph.nodes if stage_of.get(n) == s and n.op != "output"]
        own = [n for n in own if n.op != "placeholder"]
        if not own:
            raise ValueError(f"stage {s} would compute nothing: move its split points apart")
        inputs = placeholders if s == 0 else crossing[s - 1]
        last = s == num_stages - 1
        module = _build_stage(
            traced, s, own, inputs, None if last else crossing[s], output if last else None
        )
        stages.append(
            Stage(
                index=s,
                module=module,
                inputs=_names(module, "placeholder"),
                outputs=() if last else tuple(n.name for n in crossing[s]),
            )
        )
    ins = tuple(_structure(n.meta.get("example")) for n in placeholders)
    out = _example(output.args[0])
    if not nested.travels(out):
        _output_leaves(fx.Graph(), output.args[0])  # raises, naming what is returned
    return GraphSplit(
        stages=stages, shared=_shared(stages), input_structures=ins,
        output_structure=nested.structure_of(out),
    )  # fmt: skip


def _names(module: fx.GraphModule, op: str) -> tuple[str, ...]:
    return tuple(n.name for n in module.graph.nodes if n.op == op)


def _structure(example: Any) -> nested.Structure:
    """A network input's structure (a value that does not travel counts as one input)."""
    return nested.structure_of(example) if nested.travels(example) else None


def _shared(stages: Sequence[Stage]) -> dict[str, tuple[int, ...]]:
    users: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for stage in stages:
        for key, name in _parameters_used(stage.module).items():
            users.setdefault(key, []).append(stage.index)
            names.setdefault(key, name)
    return {names[k]: tuple(v) for k, v in users.items() if len(v) > 1}


def run_chain(split: GraphSplit, *inputs: torch.Tensor):
    """Run every stage in one process, each on the previous one's outputs: the network's
    output, computed stage by stage (what the pipeline runtime does across processes)."""
    values: tuple = tuple(
        t for x in inputs for t in (nested.flatten(x)[0] if nested.travels(x) else [x])
    )
    for stage in split.stages[:-1]:
        values = stage.module(*values)
    out = split.stages[-1].module(*values)
    return nested.unflatten(out if split.output_structure is not None else (out,),
                            split.output_structure)  # fmt: skip


def units(model: nn.Module, open_above: int | None = None) -> list[str]:
    """Candidate split points: the root's children, with containers (``Sequential``,
    ``ModuleList``, ``ModuleDict``) opened, and any module holding more than ``open_above``
    parameters opened too (a ResNet block too big to balance is cut between its layers:
    the skip then crosses the cut), in registration order."""
    found: list[str] = []

    def size(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            container = isinstance(child, nn.Sequential | nn.ModuleList | nn.ModuleDict)
            too_big = open_above is not None and size(child) > open_above
            if (container or too_big) and len(list(child.children())):
                visit(child, path + ".")
            else:
                found.append(path)

    visit(model, "")
    return found
