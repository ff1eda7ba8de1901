"""What a worker shows of a shared epoch under ``async_sgd`` (work sharing on).

The workers share each epoch's batches on demand, so no worker knows how many it will
take: Lightning's progress bar, which reads the epoch's whole batch count as its total,
would stop at about ``1/W`` of it (``72/144 [50%]`` with two workers) when the epoch ends.
Here the bar counts this worker's batches with no total, and at the end of each epoch every
worker prints one line with the number of batches it trained (when a progress bar is on).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks.progress import ProgressBar
from tqdm import tqdm
from typing_extensions import override

_OWN_PROGRESS_CLASSES: dict[type, type] = {}


def _sharing(strategy: Any) -> bool:
    """The strategy hands batches out on demand this epoch (its shared sampler is in use)."""
    return getattr(strategy, "sampler", None) is not None


def _own_progress_class(cls: type) -> type:
    """``cls`` whose training total is unknown (``inf``) while the epoch is shared."""
    if cls not in _OWN_PROGRESS_CLASSES:

        def total_train_batches(self) -> int | float:
            if _sharing(self.trainer.strategy):
                return float("inf")
            return super(own, self).total_train_batches

        own = type(cls.__name__, (cls,), {"total_train_batches": property(total_train_batches)})
        _OWN_PROGRESS_CLASSES[cls] = own
    return _OWN_PROGRESS_CLASSES[cls]


class SharedEpochReport(pl.Callback):
    """At each shared epoch's end, one line: how many batches this worker trained. Printed
    beside a progress bar only: benchmarks and the check, which turn it off, stay quiet."""

    def __init__(self) -> None:
        self.batches = 0

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.batches = 0

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self.batches += 1

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        if not _sharing(strategy) or trainer.progress_bar_callback is None:
            return
        line = (
            f"async_sgd epoch {trainer.current_epoch}: worker {trainer.global_rank} trained "
            f"{self.batches} of the epoch's {strategy.sampler.num_batches} shared batches"
        )
        tqdm.write(line)  # a line of its own, not glued to rank 0's progress bar


def show_own_progress(trainer: pl.Trainer) -> None:
    """Make ``trainer``'s progress bars count this worker's batches with no total, and add
    one :class:`SharedEpochReport` (calling it again adds nothing)."""
    for callback in trainer.callbacks:
        if (
            isinstance(callback, ProgressBar)
            and type(callback) not in _OWN_PROGRESS_CLASSES.values()
        ):
            callback.__class__ = _own_progress_class(type(callback))
    if not any(isinstance(c, SharedEpochReport) for c in trainer.callbacks):
        trainer.callbacks.append(SharedEpochReport())
