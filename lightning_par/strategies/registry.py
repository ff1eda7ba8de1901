"""The one table of registered strategy names; every listing derives from it.

The registry, the CLI's choices, the check and the benchmarks read :func:`strategy_specs`.
The allreduce rows are one per key of :data:`lightning_par.collectives.ALGORITHMS` (described
in ``DESCRIPTIONS``), so a new collective is a new strategy.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_par.collectives import ALGORITHMS, DESCRIPTIONS
from lightning_par.strategies.allreduce import AllReduceStrategy
from lightning_par.strategies.async_sgd import AsyncSGDStrategy
from lightning_par.strategies.gpipe import GPipeStrategy
from lightning_par.strategies.hybrid import HybridStrategy
from lightning_par.strategies.layerwise import LayerwiseStrategy
from lightning_par.strategies.local_sgd import LocalSGDStrategy
from lightning_par.strategies.parameter_server import ParameterServerStrategy
from lightning_par.strategies.reference import LightningDDPStrategy
from lightning_par.strategies.tensor_parallel import TensorParallelStrategy
from lightning_par.strategies.zero import ZeroStrategy


@dataclass(frozen=True)
class StrategySpec:
    """One registered name: its class and the options it is created with."""

    name: str
    cls: type
    description: str
    kind: str  # "data parallel", "pipeline", "reference", ...
    options: dict[str, Any] = field(default_factory=dict)

    def load(self) -> type:
        """The strategy class."""
        return self.cls

    def create(self, **overrides: Any) -> Any:
        """A new strategy object with this row's options (``overrides`` win)."""
        return self.load()(**{**self.options, **overrides})


#: Every strategy besides the allreduce rows, plugins first, the reference last.
OTHER_STRATEGIES = [
    StrategySpec(
        "gpipe", GPipeStrategy,
        "GPipe pipeline: one stage per device, micro-batches", "pipeline",
    ),
    StrategySpec(
        "layerwise", LayerwiseStrategy,
        "Layer-wise model parallelism: consecutive layers per device, RNN wavefront",
        "model parallel",
    ),
    StrategySpec(
        "tensor_parallel", TensorParallelStrategy,
        "Tensor (Megatron) parallelism: each layer's weight split across devices",
        "model parallel",
    ),
    StrategySpec(
        "parameter_server", ParameterServerStrategy,
        "Synchronous sharded parameter servers: per-layer push and pull", "data parallel",
    ),
    StrategySpec(
        "async_sgd", AsyncSGDStrategy,
        "Asynchronous SGD on sharded parameter servers: each push applied at once",
        "data parallel",
    ),
    StrategySpec(
        "local_sgd", LocalSGDStrategy,
        "Local SGD: each rank steps alone, parameters ring-averaged every 4 steps",
        "data parallel", {"period": 4, "algorithm": "ring"},
    ),
    StrategySpec(
        "zero", ZeroStrategy,
        "ZeRO sharded data parallelism: optimizer state (stage 1), gradients (2) and "
        "parameters (3, default) sharded over the ranks", "data parallel",
    ),
    StrategySpec(
        "hybrid", HybridStrategy,
        "Hybrid: a dp x mp grid, data parallel (ring-allreduced gradient buckets) over "
        "replicas each split by gpipe, layerwise or tensor_parallel", "hybrid",
    ),
    StrategySpec(
        "lightning_ddp", LightningDDPStrategy,
        "Lightning's DDP (torch DistributedDataParallel) under lightning_par's launch "
        "policy: the reference the plugins are compared with", "reference",
    ),
]  # fmt: skip


def strategy_specs() -> list[StrategySpec]:
    """Every strategy lightning_par registers: one allreduce row per collective, then
    :data:`OTHER_STRATEGIES`."""
    allreduce = [
        StrategySpec(
            f"{name}_allreduce",
            AllReduceStrategy,
            f"{DESCRIPTIONS[name]}, bucketed and overlapped with backward",
            "data parallel",
            {"algorithm": name},
        )  # fmt: skip
        for name in ALGORITHMS
    ]
    return allreduce + OTHER_STRATEGIES


def plugin_names() -> list[str]:
    """The names of lightning_par's own strategies (not the reference)."""
    return [s.name for s in strategy_specs() if s.kind != "reference"]


def spec(name: str) -> StrategySpec:
    for row in strategy_specs():
        if row.name == name:
            return row
    raise KeyError(f"no lightning_par strategy named {name!r}; choose one of {plugin_names()}")


def parse_choice(text: str) -> tuple[str, dict[str, Any]]:
    """A strategy as the tools' command lines name it: ``zero`` -> ``("zero", {})``,
    ``zero:stage=1,bucket_cap_mb=2`` -> ``("zero", {"stage": 1, "bucket_cap_mb": 2})``
    (each value a Python literal, else text). The name is not checked here."""
    name, _, rest = text.partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"{text!r}: write NAME:KEY=VALUE[,KEY=VALUE] (e.g. zero:stage=1)")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value
    return name, options


def register_strategies(registry: Any = StrategyRegistry) -> None:
    """Register every row with Lightning (``Trainer(strategy="<name>")``)."""
    for row in strategy_specs():
        if row.name not in registry:
            registry.register(row.name, row.load(), description=row.description, **row.options)
