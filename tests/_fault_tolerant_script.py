"""A user's script, run by ``tests/test_fault_tolerance.py`` as ``python
_fault_tolerant_script.py STRATEGY DEVICES FAULT OUT [VARIANT]``:
``LIGHTNING_PAR_FAULT=FAULT`` (or none for ``-``), one ``fit`` of a small network on
``DEVICES`` CPU ranks with ``fault_tolerant=True`` (Lightning chooses the launch;
``LIGHTNING_PAR_START_METHOD`` may ask for another), then what users call after training:
``save_checkpoint`` and ``validate``; the final weights are saved to ``OUT`` and one
``RESULT {json}`` line says how it went. ``VARIANT`` (a key of :data:`VARIANTS`, default
``tiny``) switches on Lightning's features beside it: BatchNorm; ``bf16-mixed`` with
learning-rate schedulers stepped per step and per epoch; a torchvision network; a CSV
logger and a checkpoint callback; BatchNorm with those."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

import lightning_par  # noqa: F401  (registers the strategies)
from lightning_par.launch.faults import FAULT_ENV
from lightning_par.strategies.registry import spec

#: Seconds a rank may stop responding (the strategies' ``dead_peer_timeout``).
DEAD_PEER_S = 2.0
SAMPLES, BATCH, STEPS = 240, 4, 12


def tiny_net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def batchnorm_net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))


def torchvision_net() -> nn.Module:
    import torchvision  # (slow to import: only this variant needs it)

    return torchvision.models.shufflenet_v2_x0_5(num_classes=4)


@dataclass(frozen=True)
class Variant:
    """What a run switches on beside ``fault_tolerant`` (the test computes one process's
    weights from the same)."""

    net: Callable[[], nn.Module] = tiny_net
    inputs: tuple[int, ...] = (8,)
    samples: int = SAMPLES
    batch: int = BATCH
    steps: int = STEPS
    precision: str = "32-true"
    lr: float = 0.1
    #: an ExponentialLR stepped every step and a StepLR every epoch
    schedulers: bool = False
    #: the network held as ``self.model`` (as users hold a torchvision one), not ``self.net``
    attribute: str = "net"
    #: a CSVLogger in ``logs/`` and a ModelCheckpoint keeping the last one, as users have
    logged: bool = False
    #: seconds each training step sleeps (a run long enough for a replacement to join)
    pause_s: float = 0.0
    #: fits, each by a new Trainer and a new strategy (the fault in the first one only)
    fits: int = 1


VARIANTS = {
    "tiny": Variant(),
    # 6 steps an epoch over 2 workers: an epoch's end (a validation, the per-epoch
    # scheduler's step) right after a loss at step 5
    "batchnorm": Variant(batchnorm_net, samples=48),
    "bf16_schedulers": Variant(samples=48, precision="bf16-mixed", schedulers=True),
    # (a gentle rate: at 0.1 a torchvision net on random data amplifies float rounding)
    "torchvision": Variant(
        torchvision_net, (3, 32, 32), samples=64, batch=16, steps=3, lr=1e-3, attribute="model"
    ),
    "logged": Variant(logged=True),
    # 3 epochs of 20 steps over 3 ranks, each a quarter second: a replacement started a few
    # seconds after a loss joins in the middle of one and goes on into the next
    "slow": Variant(steps=60, pause_s=0.25, logged=True),
    # both at once, for a run that checks both claims of a lost rank 0
    "batchnorm_logged": Variant(batchnorm_net, samples=48, logged=True),
    "two_trainers": Variant(fits=2),
}


class Tiny(pl.LightningModule):
    """A small network with what users log: the loss each step and a torchmetrics accuracy
    per epoch, which syncs over the ranks as ``fit`` ends (after the loss)."""

    def __init__(self, variant: str = "tiny") -> None:
        super().__init__()
        self.variant = VARIANTS[variant]
        setattr(self, self.variant.attribute, self.variant.net())
        self.train_acc = MulticlassAccuracy(4, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.variant.attribute)(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        time.sleep(self.variant.pause_s)
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.train_acc.update(logits, y)
        self.log("train_loss", loss)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.variant.lr, momentum=0.9)
        if not self.variant.schedulers:
            return optimizer
        per_step = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.8)
        per_epoch = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)
        return [optimizer], [{"scheduler": per_step, "interval": "step"}, per_epoch]


def data(variant: str = "tiny") -> TensorDataset:
    v, g = VARIANTS[variant], torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(v.samples, *v.inputs, generator=g),
        torch.randint(0, 4, (v.samples,), generator=g),
    )


def trainer_for(name: str, devices: int, setting: Variant) -> pl.Trainer:
    row = spec(name)
    strategy = row.cls(**row.options, fault_tolerant=True, dead_peer_timeout=DEAD_PEER_S)
    logged = setting.logged
    return pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=setting.steps,
        precision=setting.precision, enable_progress_bar=False, enable_model_summary=False,
        logger=CSVLogger("logs") if logged else False, log_every_n_steps=1,
        callbacks=[ModelCheckpoint(save_last=True)] if logged else [],
        enable_checkpointing=logged,
    )  # fmt: skip


def main(name: str, devices: int, fault: str, out: str, variant: str = "tiny") -> None:
    if fault != "-":
        os.environ[FAULT_ENV] = fault  # read by the strategy's constructor
    setting = VARIANTS[variant]
    trainer = trainer_for(name, devices, setting)
    os.environ.pop(FAULT_ENV, None)  # (a later fit's strategy runs without it)
    torch.manual_seed(0)
    model = Tiny(variant)
    started = time.monotonic()
    for fit in range(setting.fits):
        trainer = trainer if fit == 0 else trainer_for(name, devices, setting)
        try:
            train, val = (DataLoader(data(variant), batch_size=setting.batch) for _ in range(2))
            trainer.fit(model, train, val)
        except Exception as err:
            if fit == 0 or trainer.is_global_zero:  # (a later fit: every survivor raises)
                raised = {"type": type(err).__name__, "message": str(err), "fit": fit}
                print("RESULT " + json.dumps({"raised": raised}), flush=True)
            return
    fit_s = time.monotonic() - started
    trainer.save_checkpoint(os.path.join(os.path.dirname(out), "final.ckpt"))
    val = DataLoader(data(variant), batch_size=setting.batch)
    metrics = trainer.validate(model, val, verbose=False)
    if trainer.is_global_zero:  # (under popen every rank runs this script)
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out)
        members = getattr(trainer.strategy, "resilience", None)
        members = members.members if members is not None else None
        result = {"raised": None, "fit_s": fit_s, "val_loss": metrics[0]["val_loss"],
                  "members": members}  # fmt: skip
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])
