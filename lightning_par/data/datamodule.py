"""``CIFAR10DataModule``: one LightningDataModule for every data source."""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset, random_split
from typing_extensions import override

from lightning_par import _compat
from lightning_par.data.datasets import ImageTensorDataset, Subset, eval_transform, train_transform
from lightning_par.data.device import DeviceBatches
from lightning_par.data.sources import (
    MINI_ENV,
    DataNotFoundError,
    batches_dir,
    find_cifar10_mini,
    has_full_cifar10,
    how_to_get_data,
    load_batches,
    load_torchvision,
    synthesize,
    verify_md5sums,
)

SOURCES = ("auto", "torchvision", "cifar10-mini", "folder", "synthetic")
DATA_ENV = "LIGHTNING_PAR_DATA"


def default_data_dir() -> Path:
    """``$LIGHTNING_PAR_DATA`` if set, else ``datasets/`` in the current directory."""
    return Path(os.environ.get(DATA_ENV, "datasets"))


def data_rank(trainer: pl.Trainer) -> tuple[int, int]:
    """``(rank, replicas)`` of this process's shard: the data-parallel ones of Lightning's
    ``distributed_sampler_kwargs`` (under ``hybrid`` the ranks of one replica share a shard;
    the global rank would give each pipeline stage another batch)."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None)
    if not kwargs:
        return trainer.global_rank, trainer.world_size
    return int(kwargs["rank"]), int(kwargs["num_replicas"])


class CIFAR10DataModule(pl.LightningDataModule):
    """CIFAR-10 from any source, with the standard augmentation and a validation split.

    Args:
        data_dir: where the data lives (default: ``$LIGHTNING_PAR_DATA`` or ``datasets/``).
            For ``cifar10-mini`` and ``folder``: a folder in the official
            ``cifar-10-batches-py`` layout or its parent.
        source: ``"torchvision"`` (full set, downloaded when ``download``),
            ``"cifar10-mini"`` (the real 5 085-image subset; found automatically when
            ``data_dir`` is not given), ``"folder"`` (any official-layout folder),
            ``"synthetic"`` (learnable, deterministic from ``seed``) or ``"auto"`` (full set
            if present or downloadable, else the folder ``data_dir`` or
            ``$LIGHTNING_PAR_CIFAR10_MINI``, else an error naming the three ways to get
            data; never synthetic data without being asked).
        batch_size: per-process batch size. 32 suits the small cifar10-mini set: with 2
            processes, 10 epochs of CifarCNN reached 42 % test accuracy at 32 (lr 0.1)
            against 33 % at 128 (lr 0.05), for 4x the optimiser steps.
        num_workers: DataLoader workers.
        val_size: images held out of the training set for validation (an int, or a
            fraction when < 1).
        synthetic_size: training images for ``source="synthetic"`` (test: a fifth).
        seed: seed of the validation split and of synthetic data.
        download: allow torchvision to download the full set.
        augment: apply random crop and flip to training images.
        drop_last: leave out each epoch's last, partial training batch (validation and
            test keep every image): the default split of cifar10-mini has 4 577 = 143 x 32
            + 1 training images, and a one-image batch makes a noisy step (its loss is one
            image's) and trips checks that need full batches (GPipe's micro-batches).
        on_device: hold the training split as one uint8 tensor on the training device and
            make each batch there (:class:`~lightning_par.data.device.DeviceBatches`:
            per-image crop and flip, ``randperm`` shuffle, rank shards, full batches).
            ``None`` (default): on CUDA devices, not on CPU. ``False``: the per-sample
            torchvision ``DataLoader`` (e.g. to change its transforms).
    """

    def __init__(
        self,
        data_dir: str | None = None,
        source: str = "auto",
        batch_size: int = 32,
        num_workers: int = 0,
        val_size: float = 0.1,
        synthetic_size: int = 4096,
        seed: int = 0,
        download: bool = True,
        augment: bool = True,
        drop_last: bool = True,
        on_device: bool | None = None,
    ) -> None:
        super().__init__()
        if source not in SOURCES:
            raise ValueError(f"source={source!r} is not one of {SOURCES}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if val_size < 0:
            raise ValueError(f"val_size must be >= 0, got {val_size}")
        self.save_hyperparameters()
        self.data_dir = Path(data_dir) if data_dir else default_data_dir()
        self.source = source
        #: The source actually used, with its location (set by :meth:`setup`).
        self.source_used: str | None = None
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None

    # -- loading ---------------------------------------------------------------------
    def _load(self, train: bool) -> tuple[torch.Tensor, torch.Tensor, str]:
        hp = self.hparams
        if self.source == "synthetic":
            size = hp.synthetic_size if train else max(1, hp.synthetic_size // 5)
            return (*synthesize(size, hp.seed, split=0 if train else 1), "synthetic")
        if self.source == "torchvision":
            return (*self._torchvision(train, hp.download), "torchvision CIFAR-10")
        if self.source in ("cifar10-mini", "folder"):
            return self._folder(train, allow_mini=self.source == "cifar10-mini")
        # auto: the full set, then a local folder, then a clear error (raised outside the
        # except block, so the user sees one message, not two chained tracebacks)
        try:
            return (*self._torchvision(train, hp.download), "torchvision CIFAR-10")
        except DataNotFoundError:
            pass
        return self._folder(train, allow_mini=False)

    def _torchvision(self, train: bool, download: bool):
        try:
            return load_torchvision(self.data_dir, train, download)
        except (RuntimeError, OSError) as err:  # offline, or files absent / corrupt
            raise DataNotFoundError(
                f"torchvision could not provide CIFAR-10 ({err}).\n"
                + how_to_get_data(self.data_dir)
            ) from None

    def _folder(self, train: bool, allow_mini: bool):
        folder = batches_dir(self.data_dir)
        if folder is None and not self.hparams.data_dir:
            # cifar10-mini is looked for beside the project; auto takes only a configured one
            # (a configured one that is wrong raises, naming the variable).
            mini = find_cifar10_mini() if allow_mini or os.environ.get(MINI_ENV) else None
            folder = batches_dir(mini) if mini else None
        if folder is None:
            raise DataNotFoundError(how_to_get_data(self.data_dir))
        verify_md5sums(folder)
        images, labels = load_batches(folder, train)
        return images, labels, f"CIFAR-10 batches folder {folder}"

    # -- Lightning hooks ---------------------------------------------------------------
    @override
    def prepare_data(self) -> None:
        # Runs once per node before the ranks split: the only place that may download.
        # Files already there: nothing to do (torchvision would read all 60 000 images
        # just to find that out; setup verifies its checksums when it loads them).
        if self.source in ("torchvision", "auto") and self.hparams.download:
            if has_full_cifar10(self.data_dir):
                return
            try:
                load_torchvision(self.data_dir, True, True)
                load_torchvision(self.data_dir, False, True)
            except (RuntimeError, OSError):
                if self.source == "torchvision":
                    raise DataNotFoundError(
                        "torchvision could not download CIFAR-10 (no internet?).\n"
                        + how_to_get_data(self.data_dir)
                    ) from None

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        images, labels, where = self._load(train=True)
        train_tf = train_transform() if hp.augment else eval_transform()
        full = ImageTensorDataset(images, labels)
        n_val = int(round(hp.val_size * len(full))) if hp.val_size < 1 else int(hp.val_size)
        if n_val >= len(full):
            raise ValueError(f"val_size={hp.val_size} leaves no training images of {len(full)}")
        split = random_split(
            range(len(full)), [len(full) - n_val, n_val], torch.Generator().manual_seed(hp.seed)
        )
        self.train_set = Subset(full, list(split[0]), train_tf)
        self.val_set = Subset(full, list(split[1]), eval_transform())
        test_images, test_labels, _ = self._load(train=False)
        self.test_set = ImageTensorDataset(test_images, test_labels, eval_transform())
        self.source_used = where
        rank_zero_info(
            f"lightning_par data: {where}: {len(self.train_set)} train, {len(self.val_set)} "
            f"validation, {len(self.test_set)} test images"
        )

    def _loader(self, dataset, shuffle: bool, drop_last: bool = False) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.hparams.batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            num_workers=self.hparams.num_workers,
            persistent_workers=self.hparams.num_workers > 0,
        )

    @override
    def train_dataloader(self):
        device = self.training_device()
        if device is None:
            # Lightning keeps drop_last when it swaps in its DistributedSampler, so every rank's
            # shard, and async_sgd's shared batches, end with a full batch too.
            return self._loader(self.train_set, shuffle=True, drop_last=self.hparams.drop_last)
        trainer = self.trainer
        rank, world = 0, 1
        if trainer is not None and getattr(trainer.strategy, "shards_data", True):
            if _compat.uses_distributed_sampler(trainer):
                rank, world = data_rank(trainer)
        subset = self.train_set
        index = torch.as_tensor(subset.indices)
        images = subset.base.images[index].to(device)
        labels = torch.as_tensor(subset.base.labels)[index].to(device)
        hp = self.hparams
        return DeviceBatches(images, labels, hp.batch_size, rank, world, hp.augment, hp.seed)

    def training_device(self) -> torch.device | None:
        """Where :meth:`train_dataloader` makes its batches, or ``None`` for the per-sample
        ``DataLoader`` (``on_device``: by default on CUDA only)."""
        trainer = self.trainer
        device = trainer.strategy.root_device if trainer is not None else torch.device("cpu")
        on = self.hparams.on_device
        return device if (device.type == "cuda" if on is None else on) else None

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)

    @override
    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)
