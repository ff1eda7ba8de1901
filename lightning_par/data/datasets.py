"""The CIFAR-10 datasets: uint8 images transformed on access (normalised like CIFAR, with the
standard augmentation for training), the learnable synthetic set, and a split of the
training images that keeps its own transform."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset
from torchvision.transforms import v2

from lightning_par.data.sources import CIFAR_MEAN, CIFAR_STD, CLASSES, synthesize


def eval_transform() -> v2.Compose:
    return v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(CIFAR_MEAN, CIFAR_STD)])


def train_transform() -> v2.Compose:
    """The standard CIFAR augmentation: 4-pixel padded random crop, horizontal flip."""
    return v2.Compose(
        [v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip(), *eval_transform().transforms]
    )


class ImageTensorDataset(Dataset):
    """uint8 images ``[N, 3, 32, 32]`` and labels, transformed on access."""

    classes = CLASSES

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform=None) -> None:
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        image = self.images[index]
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.labels[index])


class SyntheticCIFAR10(ImageTensorDataset):
    """Learnable synthetic CIFAR-shaped data (see :func:`~lightning_par.data.sources.synthesize`),
    normalised like CIFAR, with no augmentation unless ``transform`` is given."""

    def __init__(self, size: int = 2048, seed: int = 0, train: bool = True, transform=None):
        images, labels = synthesize(size, seed, split=0 if train else 1)
        super().__init__(images, labels, eval_transform() if transform is None else transform)


class Subset(Dataset):
    """A split of the training images that keeps its own transform."""

    def __init__(self, base: ImageTensorDataset, indices: list[int], transform) -> None:
        self.base, self.indices, self.transform = base, indices, transform

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        j = self.indices[i]
        return self.transform(self.base.images[j]), int(self.base.labels[j])
