"""The CIFAR-10 datasets: uint8 images transformed on access (normalised like CIFAR, with the
standard augmentation for training), the learnable synthetic set, and a split of the
training images that keeps its own transform.

The transforms are written here rather than taken from ``torchvision.transforms.v2``: they
compute exactly what torchvision's ``RandomCrop(32, padding=4)``, ``RandomHorizontalFlip()``,
``ToDtype(torch.float32, scale=True)`` and ``Normalize(CIFAR_MEAN, CIFAR_STD)`` compute,
drawing the same random numbers in the same order (``tests/test_data.py`` compares them),
and they keep the data path free of torchvision's import: a torchvision whose compiled
operators do not load beside the installed torch (the index's CUDA build beside a CPU torch
2.13) would otherwise stop every fit before it starts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from lightning_par.data.sources import CIFAR_MEAN, CIFAR_STD, CLASSES, synthesize

Transform = Callable[[torch.Tensor], torch.Tensor]


class Compose:
    """Transforms applied in order (``transforms``: the list, as torchvision's ``Compose``)."""

    def __init__(self, transforms: Sequence[Transform]) -> None:
        self.transforms = list(transforms)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        for transform in self.transforms:
            image = transform(image)
        return image


class ScaleAndNormalise:
    """uint8 ``[C, H, W]`` to float32 in [0, 1], then standardised per channel (torchvision's
    ``ToDtype(float32, scale=True)`` then ``Normalize(mean, std)``, operation for operation)."""

    def __init__(self, mean: Sequence[float] = CIFAR_MEAN, std: Sequence[float] = CIFAR_STD):
        self.mean = torch.as_tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        scaled = image.to(torch.float32).mul_(1.0 / 255)
        return scaled.sub(self.mean.to(image.device)).div_(self.std.to(image.device))


class RandomCrop:
    """A random ``size`` crop of the image zero-padded by ``padding`` on every side: the
    top row drawn first, then the left column (as torchvision's ``RandomCrop``)."""

    def __init__(self, size: int = 32, padding: int = 4) -> None:
        self.size, self.padding = size, padding

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        padded = F.pad(image, (self.padding,) * 4)  # zeros
        height, width = padded.shape[-2:]
        top = int(torch.randint(0, height - self.size + 1, size=()))
        left = int(torch.randint(0, width - self.size + 1, size=()))
        return padded[..., top : top + self.size, left : left + self.size]


class RandomHorizontalFlip:
    """The image mirrored left to right with probability ``p`` (one ``torch.rand(1)``)."""

    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image.flip(-1) if torch.rand(1) < self.p else image


def eval_transform() -> Compose:
    return Compose([ScaleAndNormalise()])


def train_transform() -> Compose:
    """The standard CIFAR augmentation: 4-pixel padded random crop, horizontal flip."""
    return Compose([RandomCrop(32, padding=4), RandomHorizontalFlip(), ScaleAndNormalise()])


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
