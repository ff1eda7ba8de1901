"""Callbacks for the ``lightning-par`` command: training throughput, an early estimate of
the fit's duration, the model summary of the whole (unsplit) model, and the one-line run
summary."""

from __future__ import annotations

import logging
import math
import re
import time
from contextlib import contextmanager

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelSummary
from typing_extensions import override

from lightning_par import _compat
from lightning_par.output import say


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

    @override
    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._last = time.perf_counter()

    @override
    def on_validation_end(self, trainer, pl_module) -> None:
        self._last = time.perf_counter()

    @override
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

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        metrics = trainer.callback_metrics
        metrics["train_images_per_s"] = torch.tensor(self.images_per_second)
        metrics["epochs_completed"] = torch.tensor(float(trainer.current_epoch))


def strategy_label(strategy: object) -> str:
    """The name a strategy is registered under (``ring_allreduce``, ``tree_allreduce``, ...;
    one class serves several names, so the class name cannot tell them apart)."""
    name = getattr(strategy, "strategy_name", None)  # ours, and some of Lightning's
    if isinstance(name, str) and name:
        return name
    from lightning.pytorch.strategies import DDPStrategy

    if type(strategy) is DDPStrategy:  # Lightning registers ddp, ddp_spawn, ddp_fork, ...
        method = getattr(strategy, "_start_method", "popen")
        return "ddp" if method == "popen" else f"ddp_{method}"
    return type(strategy).__name__


def summary_line(trainer: pl.Trainer, datamodule=None) -> str:
    """``lightning_par summary: strategy=... devices=... data=... test_acc=...``"""
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    parts = [
        f"strategy={strategy_label(trainer.strategy)}",
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


def format_seconds(seconds: float) -> str:
    """``42 s``, ``4 min 05 s``, ``1 h 02 min``."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class FitTimeEstimate(pl.Callback):
    """After ``after_batches`` training batches, rank 0 prints one line with how long the
    whole fit should take: measured seconds per training batch (first batch excluded, it
    warms up) times the batches of every epoch, plus validation timed on the sanity check
    or the validation runs so far. Fits shorter than ``after_batches`` print nothing."""

    #: Without a timed validation batch, one counts as a third of a training batch:
    #: forward only, and a backward costs about two forwards.
    VAL_FRACTION = 1 / 3

    def __init__(self, after_batches: int = 20) -> None:
        self.after_batches = after_batches
        self.train_seconds = self.val_seconds = 0.0
        self.train_batches = self.val_batches = self._seen = 0
        self._last: float | None = None
        self._val_start = self._fit_start = 0.0
        self.printed: str | None = None

    @override
    def on_fit_start(self, trainer, pl_module) -> None:
        self._fit_start = time.perf_counter()

    @override
    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._last = time.perf_counter()

    @override
    def on_validation_start(self, trainer, pl_module) -> None:
        self._val_start = time.perf_counter()

    @override
    def on_validation_batch_end(self, trainer, *args, **kwargs) -> None:
        self.val_batches += 1

    @override
    def on_validation_end(self, trainer, pl_module) -> None:
        self._last = time.perf_counter()  # validation is not training time
        self.val_seconds += self._last - self._val_start

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self._seen and self._last is not None:
            self.train_batches += 1
            self.train_seconds += now - self._last
        self._last, self._seen = now, self._seen + 1
        if self._seen == self.after_batches and self.printed is None and trainer.is_global_zero:
            self.printed = self.estimate_line(trainer, now - self._fit_start)
            if self.printed:
                say(trainer, self.printed)  # above the progress bar, not glued to it

    def estimate_line(self, trainer: pl.Trainer, elapsed: float) -> str:
        """The line, or ``""`` when the fit ends within the batches already measured."""
        per_epoch = trainer.num_training_batches
        epochs = trainer.max_epochs if trainer.max_epochs not in (None, -1) else math.inf
        total = per_epoch * epochs
        if trainer.max_steps not in (None, -1):
            total = min(total, trainer.max_steps * trainer.accumulate_grad_batches)
        if not self.train_batches or total <= self._seen:
            return ""
        per_batch = self.train_seconds / self.train_batches
        head = f"lightning_par estimate: {1 / per_batch:.1f} training batches/s"
        if math.isinf(total):
            epoch = format_seconds(per_epoch * per_batch)
            return f"{head}; one epoch of {per_epoch} batches takes about {epoch}"
        val_per_batch = (
            self.val_seconds / self.val_batches
            if self.val_batches
            else per_batch * self.VAL_FRACTION
        )
        val_total = self._val_batches_in_fit(trainer, total) * val_per_batch
        fit = total * per_batch + val_total
        # to the nearest minute: 10:41:50 reads 10:42, not 10:41
        done = time.time() + max(0.0, fit - elapsed) + 30
        finish = time.strftime("%H:%M", time.localtime(done))
        epochs_text = f"{math.ceil(total / per_epoch)} epochs x {per_epoch} batches"
        return (
            f"{head}, so this fit ({epochs_text} + validation) should take about "
            f"{format_seconds(fit)} (done around {finish})"
        )

    @staticmethod
    def _val_batches_in_fit(trainer: pl.Trainer, train_total: float) -> float:
        per_run = sum(trainer.num_val_batches) if trainer.num_val_batches else 0
        if not per_run or math.isinf(per_run):
            return 0.0
        every = trainer.val_check_batch or trainer.num_training_batches
        runs = max(1, int(train_total // every)) if not math.isinf(every) else 1
        if trainer.check_val_every_n_epoch:
            runs = max(1, runs // trainer.check_val_every_n_epoch)
        return runs * per_run


class WholeModelSummary(ModelSummary):
    """Lightning's model summary, of the whole model even where the strategy keeps a part of
    it on each rank (``gpipe`` keeps one stage). The summary is taken at ``setup``, before
    the strategy splits the model, and printed at fit start as usual; if the model has more
    parameters by then (layers built in ``configure_model``), the fit-start one is printed."""

    def __init__(self, max_depth: int = 1, **summarize_kwargs) -> None:
        super().__init__(max_depth, **summarize_kwargs)
        self._before: tuple | None = None

    @staticmethod
    def _freeze(summary) -> tuple:
        # Lightning's summary counts parameters lazily: take the numbers now.
        flops = summary.total_flops if hasattr(summary, "total_flops") else 0
        data = _compat.summary_data(summary)
        return (data, summary.total_parameters, summary.trainable_parameters,
                summary.model_size, summary.total_training_modes, flops)  # fmt: skip

    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        if self._max_depth and stage == "fit":
            self._before = self._freeze(self._summary(trainer, pl_module))

    @override
    def on_fit_start(self, trainer, pl_module) -> None:
        if not self._max_depth:
            return
        now = self._freeze(self._summary(trainer, pl_module))
        chosen = self._before if self._before and self._before[1] > now[1] else now
        if trainer.is_global_zero:
            data, total, trainable, size, modes, flops = chosen
            if not flops:  # nothing was counted (no example_input_array): no column of zeros
                data = [column for column in data if column[0] != "FLOPs"]
            with _no_zero_flops_line(flops):
                self.summarize(data, total, trainable, size, modes, total_flops=flops,
                               **self._summarize_kwargs)  # fmt: skip


class _DropZeroFlops(logging.Filter):
    """Drops the ``0  Total Flops`` line from the summary Lightning logs."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        lines = [ln for ln in text.split("\n") if not re.fullmatch(r"0\s+Total Flops", ln)]
        record.msg, record.args = "\n".join(lines), ()
        return True


@contextmanager
def _no_zero_flops_line(flops: int):
    """While Lightning logs the summary table: without its total of zero FLOPs."""
    logger = logging.getLogger(ModelSummary.__module__)  # where ModelSummary.summarize logs
    drop = _DropZeroFlops() if not flops else None
    if drop is not None:
        logger.addFilter(drop)
    try:
        yield
    finally:
        if drop is not None:
            logger.removeFilter(drop)
