"""Training batches made on the training device: the whole split as one uint8 tensor there.

A per-sample ``DataLoader`` runs Python and torchvision once per image (a GPU trained the
CIFAR CNN at 3.5k images/s that way against 42k for a plain loop over images already on
the GPU). Here the split lives on the device as ``uint8 [N, 3, 32, 32]`` (150 MB for
CIFAR-10's 50 000 images) and every batch is made by a few tensor operations, as in
Keller Jordan's airbench (``airbench94.py``): a ``randperm`` per epoch, shared by all ranks
(same seed) and cut into disjoint per-rank shards; then per image a random crop of the
4-pixel zero-padded image and a random horizontal flip (torchvision's ``RandomCrop(32,
padding=4)`` and ``RandomHorizontalFlip()``, drawn per image, not once per batch); then
the same normalisation as :func:`~lightning_par.data.eval_transform`.

Nothing here waits for the device: the channel statistics are copied there once per
``DeviceBatches``, not once per batch (a blocking host-to-device copy is a whole-stream
synchronisation on CUDA, which stops the host from queueing the next step's kernels while
the device still runs this one's).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from lightning_par.data.sources import CIFAR_MEAN, CIFAR_STD

PAD = 4


def channel_stats(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """CIFAR-10's per-channel mean and standard deviation, ``[1, 3, 1, 1]`` on ``device``."""
    mean = torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1).to(device)
    std = torch.tensor(CIFAR_STD).view(1, 3, 1, 1).to(device)
    return mean, std


def normalise(
    images: torch.Tensor, stats: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """uint8 ``[B, 3, H, W]`` to float32 scaled to [0, 1] and standardised per channel;
    ``stats``: :func:`channel_stats` already on the images' device (else copied there)."""
    mean, std = channel_stats(images.device) if stats is None else stats
    return (images.float().div_(255) - mean) / std


def crop_and_flip(images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """A random ``PAD``-pixel-padded crop and a random horizontal flip, drawn per image."""
    b, _, h, w = images.shape
    device = images.device
    padded = F.pad(images, (PAD, PAD, PAD, PAD))  # zeros, as RandomCrop(padding=4)
    dy = torch.randint(0, 2 * PAD + 1, (b, 1), generator=generator, device=device)
    dx = torch.randint(0, 2 * PAD + 1, (b, 1), generator=generator, device=device)
    flip = torch.rand(b, 1, generator=generator, device=device) < 0.5
    rows = dy + torch.arange(h, device=device)  # [B, H]: the rows each image keeps
    cols = torch.arange(w, device=device).expand(b, w)
    cols = torch.where(flip, w - 1 - cols, cols) + dx  # a flip reads its columns backwards
    index_b = torch.arange(b, device=device).view(b, 1, 1, 1)
    index_c = torch.arange(images.shape[1], device=device).view(1, -1, 1, 1)
    return padded[index_b, index_c, rows.view(b, 1, h, 1), cols.view(b, 1, 1, w)]


class DeviceBatches:
    """Full training batches of ``images`` for one rank, made on their device.

    Each ``iter()`` is one epoch: a permutation of all images drawn from ``seed`` and the
    epoch number (the same on every rank), this rank's share ``perm[rank::world_size]``
    cut to the common length, and ``len(self)`` full batches (the last partial one is
    dropped, as the training loader does).

    Args:
        images: uint8 ``[N, 3, H, W]``, already on the training device.
        labels: int64 ``[N]`` on the same device.
        batch_size: per rank.
        rank, world_size: this rank's shard.
        augment: per-image crop and flip (else only normalisation).
        seed: seed of the shuffles and augmentation draws.
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        augment: bool = True,
        seed: int = 0,
    ) -> None:
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(
                f"images must be uint8 [N, C, H, W], got {images.dtype} {images.shape}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        self.images, self.labels = images, labels
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.augment, self.seed = augment, seed
        self.epoch = 0
        self.stats = channel_stats(images.device)

    def __len__(self) -> int:
        return (len(self.images) // self.world_size) // self.batch_size

    def shard(self, epoch: int) -> torch.Tensor:
        """Indices of this rank's images in ``epoch``, in training order."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        perm = torch.randperm(len(self.images), generator=g)
        per_rank = len(self.images) // self.world_size
        return perm[self.rank :: self.world_size][:per_rank]

    def augmentation_generator(self, epoch: int) -> torch.Generator:
        """The generator of this rank's crops and flips in ``epoch`` (per rank and epoch,
        so ranks do not draw the same crops)."""
        g = torch.Generator(device=self.images.device)
        return g.manual_seed((self.seed * 1_000_003 + epoch) * 4099 + self.rank)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch, self.epoch = self.epoch, self.epoch + 1
        index = self.shard(epoch).to(self.images.device)  # (one copy an epoch)
        g = self.augmentation_generator(epoch) if self.augment else None
        for i in range(len(self)):
            chosen = index[i * self.batch_size : (i + 1) * self.batch_size]
            batch = self.images[chosen]
            if g is not None:
                batch = crop_and_flip(batch, g)
            yield normalise(batch, self.stats), self.labels[chosen]
