"""A callback measuring training throughput, and the one-line run summary."""

from __future__ import annotations

import time

import lightning.pytorch as pl
import torch


def data_parallel_replicas(trainer: pl.Trainer) -> int:
    """How many processes see *different* samples (1 for model-parallel strategies)."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None)
    return int(kwargs.get("num_replicas", 1)) if kwargs else 1


class ThroughputMonitor(pl.Callback):
    """Training images per second over all processes, data loading included, validation
    and the first (warm-up) batch excluded. Stored as ``train_images_per_s`` in
    ``trainer.callback_metrics`` so it travels back from launched processes."""

    def __init__(self) -> None:
        self.images = 0
        self.seconds = 0.0
        self._last: float | None = None
        self._warm = False

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._last = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        self._last = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self._warm and self._last is not None:
            x = batch[0] if isinstance(batch, (list, tuple)) else batch
            self.images += len(x) * data_parallel_replicas(trainer)
            self.seconds += now - self._last
        self._warm = True
        self._last = now

    @property
    def images_per_second(self) -> float:
        return self.images / self.seconds if self.seconds else float("nan")

    def on_train_end(self, trainer, pl_module) -> None:
        metrics = trainer.callback_metrics
        metrics["train_images_per_s"] = torch.tensor(self.images_per_second)
        metrics["epochs_completed"] = torch.tensor(float(trainer.current_epoch))


def summary_line(trainer: pl.Trainer, datamodule=None) -> str:
    """``lightning_par summary: strategy=... devices=... data=... test_acc=...``"""
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    strategy = type(trainer.strategy).__name__
    parts = [
        f"strategy={strategy}",
        f"accelerator={type(trainer.accelerator).__name__.replace('Accelerator', '').lower()}",
        f"processes={trainer.world_size}",
        f"epochs={int(metrics.get('epochs_completed', trainer.current_epoch))}",
    ]
    if datamodule is not None and getattr(datamodule, "source_used", None):
        parts.append(f"data='{datamodule.source_used}'")
    for key in ("train_images_per_s", "train_loss", "val_acc", "test_acc"):
        if key in metrics:
            parts.append(f"{key}={metrics[key]:.4g}")
    return "lightning_par summary: " + " ".join(parts)
