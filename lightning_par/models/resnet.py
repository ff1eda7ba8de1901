"""torchvision's ResNet-18 as it comes (He, Zhang, Ren & Sun, "Deep residual learning for
image recognition", CVPR 2016), held as an ordinary LightningModule.

Not an ``nn.Sequential``: the residual blocks' skips cross any cut between them, so the
model-parallel strategies cut it from its traced graph
(:mod:`lightning_par.graphcut`). GroupNorm instead of BatchNorm by default, so that every
strategy, micro-batches included, trains exactly as one process (``norm="batch"`` gives
torchvision's own BatchNorm).
"""

from __future__ import annotations

from torch import nn

from lightning_par.models.classifier import ImageClassifier

NORMS = ("group", "batch")


class ResNet18(ImageClassifier):
    """ResNet-18 for CIFAR-10's 32x32 images (11.2 M parameters); optimiser settings as
    :class:`~lightning_par.models.classifier.ImageClassifier`.

    Args:
        norm: ``"group"`` (GroupNorm with 8 groups) or ``"batch"`` (torchvision's).
    """

    def __init__(
        self,
        num_classes: int = 10,
        norm: str = "group",
        optimizer: str = "sgd",
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        scheduler: str | None = "onecycle",
    ) -> None:
        super().__init__(num_classes, optimizer, lr, momentum, weight_decay, scheduler)
        if norm not in NORMS:
            raise ValueError(f"norm={norm!r}: choose one of {NORMS}")
        self.save_hyperparameters()
        from torchvision.models import resnet18  # (only this model needs torchvision)

        layer = group_norm if norm == "group" else None
        self.net = resnet18(num_classes=num_classes, norm_layer=layer)


def group_norm(channels: int) -> nn.GroupNorm:
    """GroupNorm with 8 groups (a module-level function: the model pickles to its ranks)."""
    return nn.GroupNorm(8, channels)
