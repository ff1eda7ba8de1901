"""Lightning strategy plugins: thin adapters over the plain algorithms in this package.

Each plugin module defines its strategy classes and lists them in :data:`PLUGINS` below;
:func:`register_strategies` registers their names with Lightning when
``lightning_par`` is imported.
"""

from __future__ import annotations

import importlib

from lightning.pytorch.strategies import StrategyRegistry

#: (module, class name, registered name, description), one row per strategy.
PLUGINS: list[tuple[str, str, str, str]] = []


def register_strategies(registry=StrategyRegistry) -> None:
    for module, cls_name, name, description in PLUGINS:
        if name in registry:
            continue
        cls = getattr(importlib.import_module(f"lightning_par.strategies.{module}"), cls_name)
        registry.register(name, cls, description=description)
