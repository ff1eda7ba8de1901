"""Helpers shared by the tests of the model-split strategies (gpipe, layerwise): the same
small loader and a quiet CPU Trainer, so both compare with one process the same way."""

from __future__ import annotations

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_par.data import SyntheticCIFAR10

STEPS = 3


def loader(batch_size: int = 10, size: int = 30) -> DataLoader:
    return DataLoader(SyntheticCIFAR10(size, seed=1), batch_size=batch_size, shuffle=False)


def trainer(strategy, devices: int, **kw) -> pl.Trainer:
    kw.setdefault("max_steps", STEPS)
    kw.setdefault("logger", False)
    kw.setdefault("limit_val_batches", 0)
    kw.setdefault("enable_checkpointing", "callbacks" in kw)
    return pl.Trainer(
        strategy=strategy, devices=devices, accelerator="cpu",
        enable_progress_bar=False, enable_model_summary=False, **kw,
    )  # fmt: skip
