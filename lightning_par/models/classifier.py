"""The LightningModule shared by the example models: loss, metrics, optimiser, scheduler.

Subclasses only build ``self.net``, an ``nn.Sequential`` from images to logits, so that
data-parallel strategies see an ordinary module and model-parallel strategies (layer-wise,
pipeline) can cut it between any two of its elements.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

OPTIMIZERS = ("sgd", "adam")
SCHEDULERS = ("onecycle", "cosine", None)


class ImageClassifier(pl.LightningModule):
    """Cross-entropy classification with torchmetrics accuracy.

    Args:
        num_classes: number of classes.
        optimizer: ``"sgd"`` (with momentum) or ``"adam"``.
        lr: learning rate (the peak rate for ``"onecycle"``).
        momentum: SGD momentum.
        weight_decay: L2 penalty.
        scheduler: ``"onecycle"`` (per step), ``"cosine"`` (per epoch) or ``None`` (a
            constant rate, as equivalence tests want).
    """

    net: nn.Sequential

    def __init__(
        self,
        num_classes: int = 10,
        optimizer: str = "sgd",
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        scheduler: str | None = "onecycle",
    ) -> None:
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r}: choose one of {OPTIMIZERS}")
        if scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler={scheduler!r}: choose one of {SCHEDULERS}")
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        self.criterion = nn.CrossEntropyLoss()
        # No argument check on the training step's metric: it is a ``torch.unique`` over the
        # labels, which waits for the GPU every step, and the loss before it has already
        # refused a label out of range (``validate_args`` stays on for validation and test).
        self.train_acc = MulticlassAccuracy(num_classes, average="micro", validate_args=False)
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        logits = self(x)
        loss = self.criterion(logits, y)
        # update, not forward: the accuracy is logged per epoch only, so the batch's own
        # value, which forward would compute as well, is never read
        self.train_acc.update(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        # every step, on every rank: whether a rank logs the metric decides whether it joins
        # the metric's sync at the epoch's end (a rank that skipped it would leave the others
        # waiting there)
        self.log("train_acc", self.train_acc, prog_bar=True, on_step=False, on_epoch=True)
        return loss

    def _evaluate(self, batch, metric: MulticlassAccuracy, stage: str) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = self.criterion(logits, y)
        metric.update(logits, y)  # (logged per epoch: the batch's value is never read)
        self.log(f"{stage}_loss", loss, prog_bar=True, sync_dist=True)
        self.log(f"{stage}_acc", metric, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self._evaluate(batch, self.val_acc, "val")

    @override
    def test_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self._evaluate(batch, self.test_acc, "test")

    @override
    def predict_step(self, batch, batch_idx: int) -> torch.Tensor:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x).argmax(dim=1)

    @override
    def configure_optimizers(self):
        hp = self.hparams
        if hp.optimizer == "sgd":
            opt = torch.optim.SGD(
                self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay
            )
        else:
            opt = torch.optim.Adam(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        if hp.scheduler is None:
            return opt
        if hp.scheduler == "onecycle":
            total = max(1, int(self.trainer.estimated_stepping_batches))
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=hp.lr, total_steps=total)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        epochs = max(1, self.trainer.max_epochs or 1)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
        return {"optimizer": opt, "lr_scheduler": sched}
