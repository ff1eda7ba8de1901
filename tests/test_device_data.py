"""Batches made on the training device (``CIFAR10DataModule(on_device=True)``): per-image
augmentation, every image once per epoch, disjoint rank shards, torchvision's normalisation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_par.data import CIFAR10DataModule, eval_transform
from lightning_par.data.device import PAD, DeviceBatches, crop_and_flip, normalise


def _images(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def test_crop_and_flip_are_drawn_per_image():
    same = _images(1).expand(64, 3, 32, 32).contiguous()  # one image, 64 times
    out = crop_and_flip(same, torch.Generator().manual_seed(0))
    distinct = {out[i].numpy().tobytes() for i in range(64)}
    assert len(distinct) > 20  # 81 shifts x 2 flips: one draw per batch would give 1
    # and each is a crop of the zero-padded image, mirrored or not (torchvision's pair)
    padded = F.pad(same[0], (PAD, PAD, PAD, PAD))
    crops = [
        padded[:, y : y + 32, x : x + 32] for y in range(2 * PAD + 1) for x in range(2 * PAD + 1)
    ]
    for img in out[:8]:
        assert any(torch.equal(img, c) or torch.equal(img, c.flip(-1)) for c in crops)


def test_normalisation_equals_torchvision():
    images = _images(16)
    expected = torch.stack([eval_transform()(img) for img in images])
    assert torch.allclose(normalise(images), expected, atol=1e-6)


def _epoch_labels(batches: DeviceBatches) -> torch.Tensor:
    return torch.cat([labels for _, labels in batches])


def test_every_image_once_per_epoch_in_full_batches_and_a_new_order_each_epoch():
    n = 100
    batches = DeviceBatches(_images(n), torch.arange(n), batch_size=8, augment=False)
    first, second = _epoch_labels(batches), _epoch_labels(batches)
    assert len(batches) == 12 and len(first) == 96  # 12 full batches, 4 images left out
    assert len(set(first.tolist())) == 96 and not torch.equal(first, second)
    x, _ = next(iter(batches))
    assert x.dtype == torch.float32 and x.shape == (8, 3, 32, 32)
    # without the drop, over epochs every image is seen: the permutation covers all of them
    assert sorted(batches.shard(5).tolist()) == list(range(n))


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_shards_are_disjoint_and_cover_the_split(world_size):
    n, batch = 120, 4  # divisible by world_size * batch for both sizes
    images, labels = _images(n), torch.arange(n)
    shards = [
        _epoch_labels(DeviceBatches(images, labels, batch, rank, world_size, seed=3))
        for rank in range(world_size)
    ]
    seen = torch.cat(shards).tolist()
    assert sorted(seen) == list(range(n))  # disjoint (no repeats) and covering
    assert len({len(s) for s in shards}) == 1  # every rank runs the same number of steps


def test_augmented_batches_differ_between_ranks_and_keep_their_labels():
    n = 64
    images, labels = _images(1).expand(n, 3, 32, 32).contiguous(), torch.arange(n)
    a = next(iter(DeviceBatches(images, labels, 32, 0, 2)))[0]
    b = next(iter(DeviceBatches(images, labels, 32, 1, 2)))[0]
    assert not torch.equal(a, b)


def test_datamodule_puts_training_batches_on_the_device_when_asked(mini_dir):
    dm = CIFAR10DataModule(source="cifar10-mini", batch_size=16, on_device=True)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert isinstance(loader, DeviceBatches) and len(loader) == len(dm.train_set) // 16
    x, y = next(iter(loader))
    assert x.shape == (16, 3, 32, 32) and y.dtype == torch.int64
    # the default on CPU is the per-sample torchvision loader (custom transforms stay possible)
    default = CIFAR10DataModule(source="cifar10-mini", batch_size=16)
    default.setup("fit")
    assert default.training_device() is None
    assert isinstance(default.train_dataloader(), torch.utils.data.DataLoader)


def test_on_device_is_the_default_on_cuda_only():
    class Strategy:
        def __init__(self, device):
            self.root_device = torch.device(device)

    class Trainer:  # the two facts training_device reads; no GPU needed
        def __init__(self, device):
            self.strategy = Strategy(device)

    for device, expected in (("cuda:1", torch.device("cuda:1")), ("cpu", None)):
        dm = CIFAR10DataModule(source="synthetic")
        dm.trainer = Trainer(device)
        assert dm.training_device() == expected
    forced = CIFAR10DataModule(source="synthetic", on_device=True)
    forced.trainer = Trainer("cpu")
    assert forced.training_device() == torch.device("cpu")
    off = CIFAR10DataModule(source="synthetic", on_device=False)
    off.trainer = Trainer("cuda:0")
    assert off.training_device() is None
