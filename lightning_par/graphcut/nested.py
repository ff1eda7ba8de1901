"""Values that are tuples or lists (nested) of tensors, carried between stages as their tensors.

The transport between pipeline devices moves tensors only (one message per tensor, after a
header of shapes: :mod:`lightning_par.pipeline.messages`), as torch's own pipelining does
(``torch.distributed.pipelining`` flattens stage inputs and outputs with ``torch.utils._pytree``
and rebuilds them on the receiving stage). Here the same is done for ``tuple`` and ``list``
(nested), the containers networks pass between their layers (an LSTM's ``(h, c)``):

* :func:`flatten` / :func:`unflatten`: a value <-> its tensors in order and its
  :data:`Structure`;
* :func:`leaf_nodes` / :func:`rebuild_node`: the same inside an ``fx`` graph, where the
  sending stage indexes the container (``operator.getitem``) and the receiving one packs
  its tensors again (:func:`pack_tuple`, :func:`pack_list`).

Anything else (``None``, a number, a dict, a namedtuple, an object) does not travel:
:func:`describe` names it for the refusal.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from typing import Any, Union

import torch
from torch import fx

#: ``None`` for one tensor, else ``(tuple or list, (structure of each item, ...))``.
Structure = Union[None, tuple[type, tuple["Structure", ...]]]  # noqa: UP007 (recursive alias)


def travels(value: Any) -> bool:
    """Whether ``value`` is a tensor or a tuple/list (nested) of tensors."""
    if isinstance(value, torch.Tensor):
        return True
    return type(value) in (tuple, list) and all(travels(v) for v in value)


def describe(value: Any) -> str:
    """What ``value`` is, for a message: its type, and for a container the types inside."""
    if type(value) in (tuple, list):
        return f"{type(value).__name__}({', '.join(describe(v) for v in value)})"
    return "Tensor" if isinstance(value, torch.Tensor) else type(value).__name__


def structure_of(value: Any) -> Structure:
    """The structure of a value that travels (see :func:`travels`; else a ``TypeError``)."""
    if isinstance(value, torch.Tensor):
        return None
    if type(value) in (tuple, list):
        return (type(value), tuple(structure_of(v) for v in value))
    raise TypeError(f"only tensors and tuples/lists of tensors travel between stages, not "
                    f"{describe(value)}")  # fmt: skip


def count(structure: Structure) -> int:
    """How many tensors a value of ``structure`` holds."""
    return 1 if structure is None else sum(count(s) for s in structure[1])


def flatten(value: Any) -> tuple[list[torch.Tensor], Structure]:
    """``value``'s tensors in order (depth first) and its structure."""
    structure = structure_of(value)
    leaves: list[torch.Tensor] = []

    def visit(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            leaves.append(v)
        else:
            for item in v:
                visit(item)

    visit(value)
    return leaves, structure


def unflatten(leaves: Sequence[Any], structure: Structure) -> Any:
    """The value of ``structure`` holding ``leaves`` (the inverse of :func:`flatten`)."""
    it = iter(leaves)
    value = _build(it, structure)
    if next(it, None) is not None:
        raise ValueError(f"{len(leaves)} tensors for a structure of {count(structure)}")
    return value


def _build(it: Iterator[Any], structure: Structure) -> Any:
    if structure is None:
        return next(it)
    kind, items = structure
    return kind(_build(it, s) for s in items)


def pack_tuple(*items: Any) -> tuple:
    """A tuple of ``items`` (the receiving stage's graph rebuilds a tuple with it)."""
    return tuple(items)


def pack_list(*items: Any) -> list:
    """A list of ``items`` (the receiving stage's graph rebuilds a list with it)."""
    return list(items)


def leaf_nodes(graph: fx.Graph, node: fx.Node, example: Any) -> list[fx.Node]:
    """Nodes of ``graph`` for each tensor of ``node``'s value (``example``), depth first:
    ``node`` itself for a tensor, ``node[i][j]...`` (``operator.getitem``) for a container."""
    if isinstance(example, torch.Tensor):
        return [node]
    leaves = []
    for i, item in enumerate(example):
        child = graph.call_function(operator.getitem, (node, i))
        child.meta["example"] = item
        leaves.extend(leaf_nodes(graph, child, item))
    return leaves


def rebuild_node(graph: fx.Graph, structure: Structure, leaves: Iterator[fx.Node]) -> fx.Node:
    """A node of ``graph`` computing the value of ``structure`` from the tensors ``leaves``."""
    if structure is None:
        return next(leaves)
    kind, items = structure
    parts = tuple(rebuild_node(graph, s, leaves) for s in items)
    return graph.call_function(pack_tuple if kind is tuple else pack_list, parts)
