"""The shards of lost ranks, trained by the survivors that stand in for them.

A fault-tolerant data-parallel run (:mod:`lightning_par.components.fault_tolerance`) keeps
the global batch of every step whole after a loss: each lost rank's shard of Lightning's
``DistributedSampler`` is read by one survivor (:class:`LostShards`: the same sampler with
the lost rank's number, from the step's batch on, every other loader argument kept) and
its loss trained beside the survivor's own (:func:`with_stand_ins`). The survivors' sum of
gradients, times ``survivors / first world``, averages to what every shard of the first
world gives: what one process computes on the whole batch. The survivor's buffers (BatchNorm's
running statistics) stay those of its own batches, as without the loss
(:func:`own_buffers_kept`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from lightning_par.strategies._async_loader import rebuild_loader, user_sampler_name
from lightning_par.strategies._joiner import ResumedSampler


class StandInError(RuntimeError):
    """What a fault-tolerant run cannot train in a lost rank's place (said in full)."""


class _Shard:
    """One lost rank's batches, read from its position in the epoch."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.iterator: Iterator | None = None
        self.epoch = self.position = -1

    def batch(self, loader: Any, batch_idx: int, epoch: int | None = None) -> Any:
        on_device = not isinstance(loader, DataLoader)  # (checked: DeviceBatches)
        epoch = current_epoch(loader) if epoch is None else epoch
        if self.iterator is None or (self.epoch, self.position) != (epoch, batch_idx):
            self.iterator = _device_shard(loader, self.rank, epoch, batch_idx) if on_device else (
                _loader_shard(loader, self.rank, epoch, batch_idx)
            )  # fmt: skip
            self.epoch, self.position = epoch, batch_idx
        self.position += 1
        return next(self.iterator)


def current_epoch(loader: Any) -> int:
    """The epoch ``loader`` (a checked one: :func:`check_loader`) is reading now."""
    if isinstance(loader, DataLoader):
        return getattr(loader.sampler, "epoch", 0)
    return loader.epoch - 1  # (DeviceBatches: counted when an epoch's iterator is made)


def _loader_shard(loader: DataLoader, rank: int, epoch: int, batch_idx: int) -> Iterator:
    """Lightning's sampler numbered as the lost ``rank``, in ``epoch`` from batch
    ``batch_idx`` on."""
    shard = copy.copy(loader.sampler)
    shard.rank, shard.epoch = rank, epoch
    shard.resume_at = None  # (a replacement's own sampler starts its first epoch late)
    size = loader.batch_size or 1
    batches = BatchSampler(list(shard)[batch_idx * size :], size, loader.drop_last)
    return iter(rebuild_loader(loader, batches))


def _device_shard(loader: Any, rank: int, epoch: int, batch_idx: int) -> Iterator:
    """The project's on-device batches (``DeviceBatches``) of the lost ``rank``: the same
    permutation and, seeded by rank and epoch, the same crops and flips it would draw."""
    shard = copy.copy(loader)
    shard.rank, shard.epoch = rank, epoch
    iterator = iter(shard)
    for _ in range(batch_idx):  # (the augmentation draws of the batches before it)
        next(iterator)
    return iterator


class LostShards:
    """The shards this survivor stands in for, one reader each."""

    def __init__(self) -> None:
        self._shards: dict[int, _Shard] = {}

    def batches(
        self, loader: Any, ranks: list[int], batch_idx: int, epoch: int | None = None
    ) -> list[Any]:
        """Batch ``batch_idx`` of each of ``ranks``' shards of ``loader``, in ``epoch``
        (default: the one it is reading now; a local-SGD replay may cross an epoch's end)."""
        check_loader(loader)
        shards = [self._shards.setdefault(r, _Shard(r)) for r in ranks]
        return [shard.batch(loader, batch_idx, epoch) for shard in shards]


def check_loader(loader: Any) -> None:
    """A loader whose lost shards can be read again: one ``DataLoader`` over Lightning's
    ``DistributedSampler``, or the project's on-device batches."""
    from lightning_par.data.device import DeviceBatches  # (the data package loads torchvision)

    if isinstance(loader, DeviceBatches):
        return
    lightnings = (DistributedSampler, ResumedSampler)
    if not isinstance(loader, DataLoader) or type(loader.sampler) not in lightnings:
        own = user_sampler_name(loader) if isinstance(loader, DataLoader) else None
        what = f"your sampler {own}" if own else f"a {type(loader).__name__} training loader"
        raise StandInError(
            f"fault_tolerant=True reads a lost rank's shard again from Lightning's "
            f"DistributedSampler; this run has {what}. Use one DataLoader with batch_size "
            "(and shuffle or not), Trainer(use_distributed_sampler=True), or drop "
            "fault_tolerant"
        )
    if loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler:
        raise StandInError(
            "fault_tolerant=True batches a lost rank's shard as a DataLoader's batch_size "
            f"does; this loader has the batch sampler {type(loader.batch_sampler).__name__}"
        )


def loss_of(output: Any, where: str) -> torch.Tensor:
    """The loss a ``training_step`` returned (a tensor, or ``{"loss": ...}``)."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        raise StandInError(
            f"fault_tolerant=True trains a lost rank's batch beside this rank's own, so "
            f"training_step must return a loss (a tensor or a dict with 'loss'); {where} it "
            f"returned {type(output).__name__}"
        )
    return loss


def with_stand_ins(output: Any, extra: list[Any], scale: float) -> Any:
    """``output`` (this rank's step) whose loss keeps its value (the progress bar, the
    loggers) but whose gradient is ``scale`` times the sum of its own and the stand-ins'."""
    own = loss_of(output, "this rank's batch")
    total = own + sum(loss_of(e, "a lost rank's batch") for e in extra) if extra else own
    total = total * scale
    loss = total + (own.detach() - total.detach())
    if isinstance(output, Mapping):
        return {**output, "loss": loss}
    return loss


@contextmanager
def muted_logging(module: Any) -> Iterator[None]:
    """A lost rank's step logs nothing (this rank's own values stay in the logs)."""

    def silent(*args: Any, **kwargs: Any) -> None:
        return None

    names = ("log", "log_dict")
    saved = {n: module.__dict__[n] for n in names if n in module.__dict__}
    for name in names:
        setattr(module, name, silent)
    try:
        yield
    finally:
        for name in names:
            if name in saved:
                setattr(module, name, saved[name])
            else:
                delattr(module, name)


@contextmanager
def own_buffers_kept(module: torch.nn.Module) -> Iterator[None]:
    """A lost rank's step updates copies of this rank's buffers, dropped after it: every
    rank keeps its own buffers, updated by its own batches (BatchNorm's running statistics:
    the weights saved are rank 0's, as under Lightning's DDP), with or without a loss."""
    owners = [(m, n, b) for m in module.modules() for n, b in m.named_buffers(recurse=False)]
    for owner, name, buffer in owners:  # (not restored in place: autograd saved the copies)
        setattr(owner, name, buffer.clone())
    try:
        yield
    finally:
        for owner, name, buffer in owners:
            setattr(owner, name, buffer)


@contextmanager
def in_modes(module: torch.nn.Module, modes: list[bool]) -> Iterator[None]:
    """``module``'s submodules in training or eval mode as ``modes`` says (one flag each, in
    the order of ``modules()``), their own modes back after."""
    subs = list(module.modules())
    before = [m.training for m in subs]
    for sub, mode in zip(subs, modes):
        sub.training = mode
    try:
        yield
    finally:
        for sub, mode in zip(subs, before):
            sub.training = mode


def stand_in_outputs(
    step: Callable[[Any, int], Any], batches: list[Any], batch_idx: int, module: Any
) -> list[Any]:
    """Run the user's ``step`` on each lost rank's batch, logging nothing and leaving this
    rank's buffers as they were."""
    with muted_logging(module), own_buffers_kept(module):
        return [step(batch, batch_idx) for batch in batches]
