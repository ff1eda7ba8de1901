"""Lightning strategy plugins: thin adapters over the plain algorithms in this package.

Every plugin inherits :class:`~lightning_par.strategies._base.ParStrategy`; the names
they are registered under come from one table, :mod:`lightning_par.strategies.registry`,
registered with Lightning when ``lightning_par`` is imported. Every registered class is
importable from here, so a YAML config names it ``lightning_par.strategies.GPipeStrategy``.
"""

from __future__ import annotations

from lightning_par.strategies.reference import LightningDDPStrategy, reference_ddp
from lightning_par.strategies.registry import (
    AllReduceStrategy,
    AsyncSGDStrategy,
    GPipeStrategy,
    HybridStrategy,
    LayerwiseStrategy,
    LocalSGDStrategy,
    ParameterServerStrategy,
    StrategySpec,
    TensorParallelStrategy,
    ZeroStrategy,
    plugin_names,
    register_strategies,
    spec,
    strategy_specs,
)

__all__ = [
    "AllReduceStrategy",
    "AsyncSGDStrategy",
    "GPipeStrategy",
    "HybridStrategy",
    "LayerwiseStrategy",
    "LightningDDPStrategy",
    "LocalSGDStrategy",
    "ParameterServerStrategy",
    "TensorParallelStrategy",
    "ZeroStrategy",
    "StrategySpec",
    "plugin_names",
    "reference_ddp",
    "register_strategies",
    "spec",
    "strategy_specs",
]
