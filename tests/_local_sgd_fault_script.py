"""A user's script, run by ``tests/test_local_sgd_faults.py`` as ``python
_local_sgd_fault_script.py DEVICES PERIOD FAULT OUT [sync]``: ``LIGHTNING_PAR_FAULT=FAULT``
(or none for ``-``), one ``fit`` of a small network with dropout, Adam, a per-step LR
schedule and gradient clipping on ``DEVICES`` CPU ranks with ``local_sgd(period=PERIOD,
fault_tolerant=True)`` (Lightning chooses the launch; ``LIGHTNING_PAR_START_METHOD`` may ask
for another), the training loss logged with ``sync_dist=True`` if ``sync`` is given, then
``save_checkpoint`` and ``validate``; rank 0 saves the final weights to ``OUT`` and prints
one ``RESULT {json}`` line."""

from __future__ import annotations

import json
import os
import sys
import time

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_par  # noqa: F401  (registers the strategies)
from lightning_par.launch.faults import FAULT_ENV
from lightning_par.strategies.local_sgd import LocalSGDStrategy

#: Seconds a rank may stop responding (the strategy's ``dead_peer_timeout``).
DEAD_PEER_S = 2.0
SAMPLES, BATCH, STEPS = 240, 4, 12


class Net(pl.LightningModule):
    def __init__(self, sync: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 4))
        self.sync = sync

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=self.sync)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=0.02)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(SAMPLES, 8, generator=g), torch.randint(0, 4, (SAMPLES,), generator=g)
    )


def main(devices: int, period: int, fault: str, out: str, sync: bool = False) -> None:
    if fault != "-":
        os.environ[FAULT_ENV] = fault  # read by the strategy's constructor
    strategy = LocalSGDStrategy(period=period, fault_tolerant=True, dead_peer_timeout=DEAD_PEER_S)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=STEPS, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        gradient_clip_val=0.5, num_sanity_val_steps=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Net(sync)
    started = time.monotonic()
    train = DataLoader(data(), batch_size=BATCH, shuffle=True)
    trainer.fit(model, train, DataLoader(data(), batch_size=BATCH))
    fit_s = time.monotonic() - started
    trainer.save_checkpoint(os.path.join(os.path.dirname(out), "final.ckpt"))
    metrics = trainer.validate(model, DataLoader(data(), batch_size=BATCH), verbose=False)
    if trainer.is_global_zero:  # (under popen every rank runs this script)
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out)
        result = {"fit_s": fit_s, "val_loss": metrics[0]["val_loss"]}
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:] == ["sync"])
