"""``async_sgd`` and the user's data: the loader it rebuilds and the step count schedulers see.

With shared work (:mod:`lightning_par.paramserver.work`) each worker trains the batches it
takes, about ``1/W`` of every epoch, not the whole epoch:

* :func:`worker_share`: the optimiser steps per epoch a worker is expected to take, which
  ``trainer.estimated_stepping_batches`` reports (so OneCycleLR, set up with it, anneals);
* :func:`hold_final_lr`: a worker that takes a few more batches than its share keeps the
  schedule's last learning rate instead of stepping past its end (OneCycleLR would raise);
* :func:`rebuild_loader`: the user's DataLoader with the shared batch sampler, keeping every
  other argument (workers, ``prefetch_factor``, ``generator``, ``timeout``,
  ``multiprocessing_context``, ...);
* :func:`user_sampler_name`: a sampler of the user's (which Lightning wraps in a
  ``DistributedSamplerWrapper``) is honoured: that loader keeps Lightning's fixed shards;
* :func:`shared_loader`: the training loader over a shared sampler, or a warning why not;
* :func:`count_shared_batches`: the loop's batch count for a sampler without a length.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from lightning_par import _compat
from lightning_par.paramserver.work import SharedBatchSampler

#: DataLoader arguments besides the data and how it is sampled and batched.
_KEPT = tuple(
    name
    for name in inspect.signature(DataLoader.__init__).parameters
    if name
    not in (
        "self",
        "dataset",
        "batch_size",
        "shuffle",
        "sampler",
        "batch_sampler",
        "drop_last",
    )  # fmt: skip
)


def worker_share(batches: int, workers: int) -> int:
    """A worker's expected batches per epoch when ``workers`` share ``batches``."""
    return max(1, math.ceil(batches / max(1, workers)))


def rebuild_loader(dataloader: DataLoader, batch_sampler: Sampler) -> DataLoader:
    """``dataloader`` with ``batch_sampler`` instead of its sampling and batching, every
    other argument kept."""
    kwargs = {name: getattr(dataloader, name) for name in _KEPT if hasattr(dataloader, name)}
    return DataLoader(dataloader.dataset, batch_sampler=batch_sampler, **kwargs)


def user_sampler_name(dataloader: DataLoader) -> str | None:
    """The class name of the user's own sampler inside Lightning's distributed sampler, or
    ``None`` when Lightning's plain ``DistributedSampler`` stands for a shuffle or not."""
    sampler = dataloader.sampler
    if isinstance(sampler, DistributedSamplerWrapper):
        inner = getattr(sampler.dataset, "_sampler", None)
        return type(inner).__name__ if inner is not None else "a custom sampler"
    return None


#: Scheduler classes whose ``step`` stops at the schedule's end, one per original class.
_HELD_CLASSES: dict[type, type] = {}


def _held_class(cls: type) -> type:
    if cls not in _HELD_CLASSES:

        def step(self: Any, *args: Any, **kwargs: Any) -> None:
            if self.last_epoch >= self.total_steps - 1:
                return  # past the schedule's end: keep its last learning rate
            super(held, self).step(*args, **kwargs)

        attrs = {"step": step, "_lightning_par_held": True, "__module__": cls.__module__}
        held = type(cls.__name__, (cls,), attrs)
        _HELD_CLASSES[cls] = held
    return _HELD_CLASSES[cls]


def hold_final_lr(scheduler: Any) -> None:
    """Stop ``scheduler`` stepping past a fixed end (``total_steps``, OneCycleLR's): the
    worker keeps the last learning rate of the schedule.

    The scheduler's class is swapped for a subclass rather than its ``step`` patched on the
    instance: a scheduler's ``state_dict`` is its ``__dict__``, so an instance attribute
    would land in every checkpoint (and a local function cannot be pickled)."""
    if getattr(scheduler, "total_steps", None) is None:
        return
    if not getattr(type(scheduler), "_lightning_par_held", False):
        scheduler.__class__ = _held_class(type(scheduler))


def shared_loader(
    dataloader: object, next_batch: Callable[[int, int], tuple[int, int]]
) -> tuple[DataLoader, SharedBatchSampler] | None:
    """``dataloader`` rebuilt over a :class:`SharedBatchSampler` that asks ``next_batch``,
    and that sampler; ``None`` (with a warning saying why) where the loader keeps
    Lightning's fixed shards: a sampler of the user's, or no distributed sampler."""
    own = user_sampler_name(dataloader) if isinstance(dataloader, DataLoader) else None
    if own is not None:
        rank_zero_warn(
            f"async_sgd keeps your sampler {own}: the workers read Lightning's fixed "
            "shards of it instead of sharing batches on demand (share_work)"
        )
        return None
    if not isinstance(dataloader, DataLoader) or not isinstance(
        dataloader.sampler, DistributedSampler
    ):
        rank_zero_warn(
            "async_sgd shares batches only over Lightning's distributed sampler "
            "(use_distributed_sampler=True and a DataLoader with batch_size); this "
            "train_dataloader keeps its own fixed shards"
        )
        return None
    old = dataloader.sampler
    sampler = SharedBatchSampler(
        len(old.dataset), dataloader.batch_size or 1, dataloader.drop_last, old.shuffle,
        old.seed, next_batch,
    )  # fmt: skip
    return rebuild_loader(dataloader, sampler), sampler


def count_shared_batches(
    trainer: pl.Trainer,
    sampler: Callable[[], SharedBatchSampler | None],
    connected: Callable[[], bool],
    workers: int,
) -> None:
    """A shared sampler has no length (so that Lightning fetches one batch ahead and sees
    the epoch's last): the loop may run up to the whole epoch, while
    ``estimated_stepping_batches`` (schedulers, read before the servers start) counts a
    worker's share, ``1/W`` of it (:func:`worker_share`). ``sampler()``: the current shared
    sampler, if any; ``connected()``: whether the servers are up."""
    loop = trainer.fit_loop

    def after_setup_data() -> None:
        shared = sampler()
        if shared is not None and loop.max_batches == float("inf"):
            limit = trainer.limit_train_batches
            total = shared.num_batches
            loop.max_batches = min(total, limit) if isinstance(limit, int) else total
            if not connected():  # what a scheduler set up now should count
                loop.max_batches = worker_share(int(loop.max_batches), workers)
        if shared is not None and not connected():
            # set up early (a scheduler asked for the step count): Lightning already
            # began epoch 0's iterator, which found no servers; build it again later
            _compat.reset_combined_loader(loop)

    _compat.wrap_setup_data(loop, after_setup_data)
