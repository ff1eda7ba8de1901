"""A small residual CNN for CIFAR-10, written as an ``nn.Sequential`` of blocks.

Residual blocks (He et al., 2016, "Deep Residual Learning for Image Recognition") keep
their skip connection *inside* each block, so the network is a plain chain and a
layer-wise or pipeline strategy can cut it between any two blocks.

GroupNorm (Wu & He, 2018) is the default normalisation because it computes statistics per
sample: a batch gives the same result whole or in GPipe's micro-batches, which BatchNorm
does not (its statistics depend on which samples share a batch).
"""

from __future__ import annotations

from torch import nn

from lightning_par.models.classifier import ImageClassifier

NORMS = ("group", "batch", "none")


def make_norm(kind: str, channels: int) -> nn.Module:
    if kind == "group":
        # About 8 channels a group, at most 8 groups: one channel a group (instance norm)
        # would erase each image's mean colour, which CIFAR classes depend on.
        return nn.GroupNorm(min(8, max(1, channels // 8)), channels)
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    return nn.Identity()


class ResidualBlock(nn.Module):
    """conv-norm-relu-conv-norm plus a (projected when the shape changes) skip, then relu."""

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1, norm: str = "group") -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False),
            make_norm(norm, out_ch),
            nn.ReLU(inplace=True),
            nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False),
            make_norm(norm, out_ch),
        )
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.skip = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), make_norm(norm, out_ch)
            )
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(self.body(x) + self.skip(x))


def build_cnn(width: int = 32, num_blocks: int = 4, norm: str = "group", num_classes: int = 10):
    """Stem, ``num_blocks`` residual blocks (channels double and the image halves every
    second block), then a pooling classifier head: ``num_blocks + 2`` cut points."""
    if norm not in NORMS:
        raise ValueError(f"norm={norm!r}: choose one of {NORMS}")
    if width < 1 or num_blocks < 1:
        raise ValueError(f"width and num_blocks must be >= 1, got {width} and {num_blocks}")
    layers: list[nn.Module] = [
        nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False),
            make_norm(norm, width),
            nn.ReLU(inplace=True),
        )
    ]
    channels = width
    for i in range(num_blocks):
        out = width * 2 ** ((i + 1) // 2)
        layers.append(ResidualBlock(channels, out, stride=2 if out != channels else 1, norm=norm))
        channels = out
    layers.append(
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes))
    )
    return nn.Sequential(*layers)


class CifarCNN(ImageClassifier):
    """Residual CNN classifier for 32x32 RGB images.

    Args:
        width: channels of the stem (later blocks use 2x and 4x).
        num_blocks: residual blocks between the stem and the head.
        norm: ``"group"`` (micro-batch invariant, default), ``"batch"`` or ``"none"``.
        **kwargs: optimiser settings of :class:`ImageClassifier`.
    """

    def __init__(
        self,
        width: int = 32,
        num_blocks: int = 4,
        norm: str = "group",
        num_classes: int = 10,
        optimizer: str = "sgd",
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        scheduler: str | None = "onecycle",
    ) -> None:
        super().__init__(num_classes, optimizer, lr, momentum, weight_decay, scheduler)
        self.save_hyperparameters()
        self.net = build_cnn(width, num_blocks, norm, num_classes)
