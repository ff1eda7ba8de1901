"""What a strategy shows its model splitter: the
:class:`~lightning_par.components.splitter.SplitContext` of a
:class:`~lightning_par.strategies._base.ParStrategy`, read live from it (Lightning sets the
strategy up over time: its devices and precision from the Trainer, the module when it
connects it, the communicator at setup), and nothing more."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from lightning_par import _compat
from lightning_par.comm import Communicator


class StrategyContext:
    """The splitter's view of ``strategy`` (a ``ParStrategy``): the names
    :class:`~lightning_par.components.splitter.SplitContext` lists."""

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy

    @property
    def name(self) -> str:
        return self._strategy.strategy_name

    @property
    def module(self) -> pl.LightningModule:
        return self._strategy.lightning_module

    @property
    def comm(self) -> Communicator | None:
        return self._strategy.split_comm

    @property
    def size(self) -> int:
        return self._strategy.split_size

    @property
    def rank(self) -> int:
        return self._strategy.global_rank

    @property
    def devices(self) -> list[torch.device]:
        return list(self._strategy.parallel_devices or [])

    @property
    def root_device(self) -> torch.device:
        return self._strategy.root_device

    @property
    def precision(self) -> Any:
        return self._strategy.precision_plugin

    @property
    def backend(self) -> str | None:
        return _compat.process_group_backend(self._strategy)

    @property
    def sync_batchnorm(self) -> bool:
        return _compat.layer_sync(self._strategy) is not None

    def broadcast(self, obj: Any) -> Any:
        return self._strategy.broadcast(obj)
