"""Lightning strategy plugins: thin adapters over the plain algorithms in this package.

Each plugin module defines its strategy classes and lists them in :data:`PLUGINS` below;
:func:`register_strategies` registers their names with Lightning when
``lightning_par`` is imported.
"""

from __future__ import annotations

import importlib

from lightning.pytorch.strategies import StrategyRegistry

#: (module, class name, registered name, description), one row per strategy.
PLUGINS: list[tuple[str, str, str, str]] = [
    (
        "allreduce",
        "RingAllReduceStrategy",
        "ring_allreduce",
        "Ring allreduce (reduce-scatter + all-gather), bucketed and overlapped",
    ),
    (
        "allreduce",
        "TreeAllReduceStrategy",
        "tree_allreduce",
        "Tree allreduce (reduce to rank 0, broadcast back), bucketed and overlapped",
    ),
    (
        "allreduce",
        "ButterflyAllReduceStrategy",
        "butterfly_allreduce",
        "Butterfly allreduce (recursive doubling), bucketed and overlapped",
    ),
    (
        "allreduce",
        "AllToAllAllReduceStrategy",
        "all_to_all_allreduce",
        "All-to-all allreduce (teaching baseline)",
    ),
    (
        "allreduce",
        "MasterWorkerAllReduceStrategy",
        "master_worker_allreduce",
        "Master-worker allreduce (teaching baseline)",
    ),
    ("gpipe", "GPipeStrategy", "gpipe", "GPipe pipeline: one stage per device, micro-batches"),
]


def register_strategies(registry=StrategyRegistry) -> None:
    for module, cls_name, name, description in PLUGINS:
        if name in registry:
            continue
        cls = getattr(importlib.import_module(f"lightning_par.strategies.{module}"), cls_name)
        registry.register(name, cls, description=description)
