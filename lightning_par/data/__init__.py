"""CIFAR-10 data: full set, local folders (the real ``cifar10-mini`` subset), synthetic."""

from lightning_par.data.datamodule import (
    CIFAR_MEAN,
    CIFAR_STD,
    SOURCES,
    CIFAR10DataModule,
    ImageTensorDataset,
    SyntheticCIFAR10,
    default_data_dir,
    eval_transform,
    train_transform,
)
from lightning_par.data.sources import CLASSES, DataNotFoundError, find_cifar10_mini

__all__ = [
    "CIFAR10DataModule",
    "CIFAR_MEAN",
    "CIFAR_STD",
    "CLASSES",
    "DataNotFoundError",
    "ImageTensorDataset",
    "SOURCES",
    "SyntheticCIFAR10",
    "default_data_dir",
    "eval_transform",
    "find_cifar10_mini",
    "train_transform",
]
