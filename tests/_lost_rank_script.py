"""A user's script, run by ``tests/test_lost_ranks.py`` as ``python _lost_rank_script.py
STRATEGY:FAULT ...``: for each argument, ``LIGHTNING_PAR_FAULT=FAULT`` and one ``fit`` of a
small network on two CPU ranks (Lightning chooses the launch), a checkpoint every two
steps; what ``fit`` raised is printed as one ``RESULT {json}`` line. With ``--uncaught``
first (``tests/test_lost_peers.py``: under torchrun, where every rank runs the script),
``fit`` is called as most scripts do, catching nothing."""

from __future__ import annotations

import json
import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_par  # noqa: F401  (registers the strategies)
from lightning_par.launch.faults import FAULT_ENV
from lightning_par.strategies.registry import spec

#: Seconds a rank may stop responding (the strategies' ``dead_peer_timeout``).
DEAD_PEER_S = 2.0


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(name: str, fault: str, uncaught: bool = False) -> None:
    os.environ[FAULT_ENV] = fault  # read by the strategy's constructor
    row = spec(name)
    strategy = row.cls(**row.options, dead_peer_timeout=DEAD_PEER_S)
    saver = ModelCheckpoint(dirpath=os.path.join(os.getcwd(), name), every_n_train_steps=2)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_epochs=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[saver],
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 8, generator=g), torch.randint(0, 4, (256,), generator=g))
    if uncaught:
        trainer.fit(Tiny(), DataLoader(data, batch_size=4))
        return
    try:
        trainer.fit(Tiny(), DataLoader(data, batch_size=4))
        raised = None
    except Exception as err:
        raised = {"type": type(err).__name__, "message": str(err)}
    print("RESULT " + json.dumps({"scenario": f"{name}:{fault}", "raised": raised}), flush=True)


if __name__ == "__main__":
    uncaught = sys.argv[1:2] == ["--uncaught"]
    for scenario in sys.argv[1 + uncaught :]:
        name, fault = scenario.split(":", 1)
        fit(name, fault, uncaught)
