"""A user's script, run by ``tests/test_fault_tolerance.py`` as ``python
_fault_tolerant_script.py STRATEGY DEVICES FAULT OUT``: ``LIGHTNING_PAR_FAULT=FAULT`` (or
none for ``-``), one ``fit`` of a small network on ``DEVICES`` CPU ranks with
``fault_tolerant=True`` (Lightning chooses the launch; ``LIGHTNING_PAR_START_METHOD`` may
ask for another), then what users call after training: ``save_checkpoint`` and
``validate``; the final weights are saved to ``OUT`` and one ``RESULT {json}`` line says
how it went."""

from __future__ import annotations

import json
import os
import sys
import time

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

import lightning_par  # noqa: F401  (registers the strategies)
from lightning_par.launch.faults import FAULT_ENV
from lightning_par.strategies.registry import spec

#: Seconds a rank may stop responding (the strategies' ``dead_peer_timeout``).
DEAD_PEER_S = 2.0
SAMPLES, BATCH, STEPS = 240, 4, 12


class Tiny(pl.LightningModule):
    """A small network with what users log: the loss each step and a torchmetrics accuracy
    per epoch, which syncs over the ranks as ``fit`` ends (after the loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.train_acc = MulticlassAccuracy(4, average="micro")

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.train_acc.update(logits, y)
        self.log("train_loss", loss)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(SAMPLES, 8, generator=g), torch.randint(0, 4, (SAMPLES,), generator=g)
    )


def main(name: str, devices: int, fault: str, out: str) -> None:
    if fault != "-":
        os.environ[FAULT_ENV] = fault  # read by the strategy's constructor
    row = spec(name)
    strategy = row.cls(**row.options, fault_tolerant=True, dead_peer_timeout=DEAD_PEER_S)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=STEPS, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Tiny()
    started = time.monotonic()
    try:
        train, val = (DataLoader(data(), batch_size=BATCH) for _ in range(2))
        trainer.fit(model, train, val)
    except Exception as err:
        raised = {"type": type(err).__name__, "message": str(err)}
        print("RESULT " + json.dumps({"raised": raised}), flush=True)
        return
    fit_s = time.monotonic() - started
    trainer.save_checkpoint(os.path.join(os.path.dirname(out), "final.ckpt"))
    metrics = trainer.validate(model, DataLoader(data(), batch_size=BATCH), verbose=False)
    if trainer.is_global_zero:  # (under popen every rank runs this script)
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out)
        result = {"raised": None, "fit_s": fit_s, "val_loss": metrics[0]["val_loss"]}
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
