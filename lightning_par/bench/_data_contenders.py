"""The contenders of ``bench data``: a plain torch loop and two Lightning fits, each timed
over the same window of steps, each optionally profiled (:mod:`._step_profile`).

* ``torch_loop``: forward, backward and step over batches written out as a hand loop
  would (airbench's), with the data module's order and seeds and its own augmentation
  functions (:func:`~lightning_par.data.device.crop_and_flip`,
  :func:`~lightning_par.data.device.normalise`): the same work as our data module's.
* ``lightning``: ``Trainer.fit`` (``strategy="auto"``, one device) with our
  ``CIFAR10DataModule(on_device=True)`` and the model as users get it.
* ``lightning_loss_only``: the same, with our pieces of the step switched off: the
  training step returns the loss, without our accuracy metric and ``self.log``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.profilers import PassThroughProfiler
from typing_extensions import override

from lightning_par.bench._step_profile import SelfTimeProfiler, profile_method
from lightning_par.data import CIFAR10DataModule
from lightning_par.data.device import DeviceBatches, channel_stats, crop_and_flip, normalise
from lightning_par.models import CifarCNN, CifarRNN

MODELS = {"CifarCNN": CifarCNN, "CifarRNN": CifarRNN}


def device_sync(device: torch.device) -> Callable[[], None]:
    """Waits for ``device``'s queued work (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


class Window:
    """The timed steps, from the end of step ``warmup`` to the end of step ``steps``: their
    seconds once the device caught up, and the window of ``profiler`` when one is given."""

    def __init__(self, run: dict[str, Any], profiler: SelfTimeProfiler | None = None) -> None:
        self.warmup, self.steps = run["warmup"], run["steps"]
        self.sync = device_sync(run["device"])
        self.profiler = profiler
        self.seconds = 0.0
        self._start = 0.0

    def step_ended(self, done: int) -> None:
        """Step number ``done`` (from 1) has ended."""
        if done == self.warmup:
            self.sync()
            self._start = time.perf_counter()
            if self.profiler is not None:
                self.profiler.begin_window()
        elif done == self.steps:
            if self.profiler is not None:
                self.profiler.end_window()
            self.sync()
            self.seconds = time.perf_counter() - self._start


class WindowCallback(pl.Callback):
    """Tells a :class:`Window` where Lightning's loop is."""

    def __init__(self, window: Window) -> None:
        self.window = window

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.window.step_ended(trainer.global_step)


class LossOnlyStep:
    """A model's training step without our metric and logging: the loss alone."""

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        return self.criterion(self(x), y)


def make_model(name: str, options: dict[str, Any], loss_only: bool = False) -> pl.LightningModule:
    """A fresh ``name`` (seed 0, constant learning rate), or its :class:`LossOnlyStep` kind."""
    cls = MODELS[name]
    if loss_only:
        cls = type(f"LossOnly{name}", (LossOnlyStep, cls), {})
    torch.manual_seed(0)
    return cls(**options, scheduler=None)


def loop_batches(images: torch.Tensor, labels: torch.Tensor, batch_size: int,
                 seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """The plain loop's batches, epoch after epoch: the data module's order and crops
    (its seeds and augmentation functions), written out as a hand loop would."""
    order = DeviceBatches(images, labels, batch_size, seed=seed)  # (its seeds only)
    stats = channel_stats(images.device)
    for epoch in itertools.count():
        index = order.shard(epoch).to(images.device)
        g = order.augmentation_generator(epoch)
        for i in range(len(order)):
            chosen = index[i * batch_size : (i + 1) * batch_size]
            yield normalise(crop_and_flip(images[chosen], g), stats), labels[chosen]


def train_images(data: CIFAR10DataModule, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The data module's training split, uint8 images and labels, on ``device``."""
    subset = data.train_set
    index = torch.as_tensor(subset.indices)
    return subset.base.images[index].to(device), torch.as_tensor(subset.base.labels)[index].to(
        device
    )


def torch_loop(run: dict[str, Any], model: pl.LightningModule, data: CIFAR10DataModule,
               profiler: SelfTimeProfiler | None = None) -> float:  # fmt: skip
    """Seconds of the plain loop's window (steps ``warmup`` to ``steps``); ``profiler``
    (begun and ended with the window) sees its four phases."""
    device, steps = run["device"], run["steps"]
    window = Window(run, profiler)
    prof = profiler or PassThroughProfiler()
    model = model.to(device)
    opt = model.configure_optimizers()
    batches = loop_batches(*train_images(data, device), data.hparams.batch_size, data.hparams.seed)
    bf16 = run["precision"] == "bf16-mixed"
    for step in range(steps):
        with prof.profile("[bench] data"):
            x, y = next(batches)
        with prof.profile("[bench] forward"):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = model.criterion(model(x), y)
        with prof.profile("[bench] backward"):
            opt.zero_grad()
            loss.backward()
        with prof.profile("[bench] optimizer"):
            opt.step()
        window.step_ended(step + 1)
    return window.seconds


def lightning_fit(run: dict[str, Any], model: pl.LightningModule, data: CIFAR10DataModule,
                  profiler: SelfTimeProfiler | None = None) -> float:  # fmt: skip
    """Seconds of a fit's window; ``profiler`` sees Lightning's hooks and our pieces."""
    window = Window(run, profiler)
    callbacks: list[pl.Callback] = [WindowCallback(window)]
    if profiler is not None:
        callbacks.append(ProfiledPieces(profiler))
    device = run["device"]
    pl.Trainer(
        accelerator=device.type, devices=1 if device.index is None else [device.index],
        strategy="auto", precision=run["precision"],
        max_steps=run["steps"], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=callbacks, profiler=profiler,
    ).fit(model, datamodule=data)  # fmt: skip
    return window.seconds


class ProfiledPieces(pl.Callback):
    """Charges the network's and the loss's forward, our metric and ``self.log``, and the
    optimiser's own update to buckets of their own (Lightning's hooks wrap them all)."""

    def __init__(self, profiler: SelfTimeProfiler) -> None:
        self.profiler = profiler

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        prof = self.profiler
        profile_method(pl_module.net, "forward", prof, "forward")
        profile_method(pl_module.criterion, "forward", prof, "forward")
        profile_method(pl_module, "log", prof, "metrics_logging")
        profile_method(pl_module.train_acc, "update", prof, "metrics_logging")
        for opt in trainer.optimizers:
            opt.register_step_pre_hook(lambda *_: prof.start("[bench] optimizer"))
            opt.register_step_post_hook(lambda *_: prof.stop("[bench] optimizer"))
