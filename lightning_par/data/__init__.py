"""CIFAR-10 data: full set, local folders (the real ``cifar10-mini`` subset), synthetic."""

from lightning_par.data.datamodule import SOURCES, CIFAR10DataModule, default_data_dir
from lightning_par.data.datasets import (
    ImageTensorDataset,
    SyntheticCIFAR10,
    eval_transform,
    train_transform,
)
from lightning_par.data.sources import (
    CIFAR_MEAN,
    CIFAR_STD,
    CLASSES,
    DataNotFoundError,
    find_cifar10_mini,
)

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
