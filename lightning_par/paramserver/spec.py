"""What a server must know about the model and the optimiser, and which optimisers it can run.

Worker 0 sends each server one :class:`ServerSpec` before training (shapes, buckets, the
shard plan, the user's optimiser class and param groups). Every header then carries the
param groups' numbers (:func:`hyper_values`), so what a scheduler changes on the workers
(OneCycle's learning rate and momentum) reaches the servers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_par.paramserver.clipping import GradClip
from lightning_par.paramserver.plan import ShardPlan

#: Optimisers that update each element from that element's gradient and state only, so
#: slicing a tensor over servers changes nothing (LBFGS, Adafactor-style factored or
#: matrix optimisers would not be exact).
ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Rprop,
)

Schema = list[tuple[str, int | None]]  # (key, index in a tuple value or None) per number


@dataclass
class ServerSpec:
    """What a server needs to know about the model, sent once by worker 0."""

    num_workers: int
    shapes: list[tuple[int, ...]]
    dtype: torch.dtype
    buckets: list[list[int]]  # parameter indices per gradient bucket, in push order
    plan: ShardPlan
    optimizer_cls: type
    groups: list[dict[str, Any]]  # each param group's hyperparameters (no "params")
    schemas: list[Schema]  # the numbers of each group that travel in every header
    group_of: list[int]  # the param group of each parameter
    opt_index: list[int]  # each parameter's index in the worker optimiser's state_dict
    clip: GradClip | None = None  # clipping of the averaged gradient, done on the servers

    @property
    def num_hyper(self) -> int:
        """Hyperparameters in every header."""
        return sum(len(schema) for schema in self.schemas)


def check_optimizer(
    optimizer: torch.optim.Optimizer, params: list[nn.Parameter], name: str = "the parameter server"
) -> None:
    """Refuse optimisers the servers cannot reproduce exactly (``name``: who refuses, the
    strategy's name under Lightning)."""
    if not isinstance(optimizer, ELEMENTWISE):
        raise ValueError(
            f"{name} cannot run {type(optimizer).__name__}: its servers apply "
            "the optimiser to slices of the parameters, which is exact only for element-wise "
            f"optimisers ({', '.join(c.__name__ for c in ELEMENTWISE)})"
        )
    in_optimizer = [p for g in optimizer.param_groups for p in g["params"]]
    if {id(p) for p in in_optimizer} != {id(p) for p in params} or len(in_optimizer) != len(params):
        raise ValueError(
            f"{name} needs one optimiser holding every trainable parameter of "
            "the model exactly once (freeze parameters with requires_grad=False instead)"
        )
    if len({p.dtype for p in params}) != 1:
        raise ValueError(f"{name} needs all trainable parameters in one dtype")


def optimizer_index(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> list[int]:
    """Each parameter's index in ``optimizer.state_dict()["state"]``."""
    order = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    return [order[id(p)] for p in params]


def server_spec(
    optimizer: torch.optim.Optimizer, params: list[nn.Parameter], num_workers: int,
    buckets: list[list[int]], plan: ShardPlan, clip: GradClip | None = None,
) -> ServerSpec:  # fmt: skip
    """The spec worker 0 sends: the model's ``params`` as the optimiser holds them."""
    groups = optimizer.param_groups
    group_of = {id(p): g for g, group in enumerate(groups) for p in group["params"]}
    return ServerSpec(
        num_workers=num_workers,
        shapes=[tuple(p.shape) for p in params],
        dtype=params[0].dtype,
        buckets=buckets,
        plan=plan,
        optimizer_cls=type(optimizer),
        groups=[{k: v for k, v in g.items() if k != "params"} for g in groups],
        schemas=[hyper_schema(g) for g in groups],
        group_of=[group_of[id(p)] for p in params],
        opt_index=optimizer_index(optimizer, params),
        clip=clip,
    )


def hyper_schema(group: dict[str, Any]) -> Schema:
    """Where the numbers of a param group are (keys in sorted order)."""
    schema: Schema = []
    for key, value in sorted(group.items()):
        if key == "params" or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            schema.append((key, None))
        elif isinstance(value, tuple) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
        ):
            schema += [(key, i) for i in range(len(value))]
    return schema


def hyper_values(groups: list[dict[str, Any]], schemas: list[Schema]) -> list[float]:
    """The numbers of every param group, in schema order (what a header carries)."""
    return [
        float(g[k] if i is None else g[k][i]) for g, schema in zip(groups, schemas)
        for k, i in schema
    ]  # fmt: skip


def set_hyper(group: dict[str, Any], schema: Schema, values: list[float]) -> None:
    """Write a header's numbers back into a param group, each in its original type."""
    for (key, i), value in zip(schema, values):
        if i is None:
            group[key] = type(group[key])(value)
        else:
            items = list(group[key])
            items[i] = type(items[i])(value)
            group[key] = tuple(items)
