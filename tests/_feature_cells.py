"""The cells of ``tests/test_features.py``: a tiny LightningModule with one everyday feature
switched on, trained the same way in one process and under a strategy (2 processes).

:func:`run_cell` trains one cell and returns what the test compares: the full model's
weights, the validation/test losses and rank 0's predictions. It runs inside ranks started
by ``run_on_ranks`` (the torchrun path: several cells per launch) or, for strategies that
start their own processes (the parameter servers), in the test process with a fork launch.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

GLOBAL_BATCH, BATCHES, STEPS = 8, 4, 4  # one epoch = 4 global batches of 8


def dataset(n: int = GLOBAL_BATCH * BATCHES, seed: int = 7) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


def rows(rank: int, world: int, shards: bool) -> torch.Tensor:
    """The sample indices this rank reads: its slice of every global batch (data parallel)
    or every sample (one process, pipeline stages)."""
    n = GLOBAL_BATCH * BATCHES
    if not shards or world == 1:
        return torch.arange(n)
    per = GLOBAL_BATCH // world
    return torch.cat([torch.arange(b + rank * per, b + (rank + 1) * per)
                      for b in range(0, n, GLOBAL_BATCH)])  # fmt: skip


def data_shard(trainer: pl.Trainer) -> tuple[int, int]:
    """(this rank's shard, shards per global batch): by the data-parallel rank where the
    strategy has one (hybrid: the model-parallel ranks of a replica read the same samples)."""
    strategy = trainer.strategy
    if hasattr(strategy, "dp_rank"):
        return strategy.dp_rank, strategy.grid.dp
    return trainer.global_rank, trainer.world_size


class Tiny(pl.LightningModule):
    """An MLP ``net`` (an ``nn.Sequential``, so the pipeline strategies can split it)."""

    def __init__(self, feature: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.feature = feature
        layers: list[nn.Module] = [nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                                   nn.Linear(16, 3)]  # fmt: skip
        if feature in ("batchnorm", "sync_batchnorm"):
            layers.insert(1, nn.BatchNorm1d(16))
        if feature == "tied_weights":  # the middle layer applied twice: one weight, two uses
            layers[4:4] = [layers[2], nn.Tanh()]
        if feature == "frozen_layer":  # frozen throughout (in the optimiser, never stepped)
            layers[2].requires_grad_(False)
        self.net = nn.Sequential(*layers)
        if feature == "unused_parameters":
            self.unused = nn.Linear(4, 4)
        if feature == "module_parameter":
            self.scale = nn.Parameter(torch.tensor(1.5))
        if feature == "unfreeze":  # the first layer: a pipeline's first stage is all frozen
            self.net[0].requires_grad_(False)
        if feature == "add_param_group":  # a head frozen, outside the optimiser, until step 2
            self.head = nn.Linear(3, 3).requires_grad_(False)
        self.automatic_optimization = feature != "manual_optimization"
        self.criterion = nn.CrossEntropyLoss()
        self.shards = True  # set by the harness: does this rank read a shard?

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        if self.feature == "add_param_group":
            out = self.head(out)
        return out * self.scale if self.feature == "module_parameter" else out

    def train_dataloader(self) -> DataLoader:
        data = dataset()
        index = rows(*data_shard(self.trainer), self.shards)
        return DataLoader(TensorDataset(*data[index]), batch_size=len(index) // BATCHES)

    def val_dataloader(self) -> DataLoader:
        return self.train_dataloader()

    test_dataloader = predict_dataloader = val_dataloader

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.feature == "unfreeze" and self.global_step == 2:
            self.net[0].requires_grad_(True)  # as a user writes it, under every strategy
        if self.feature == "add_param_group" and self.global_step == 2:
            self.head.requires_grad_(True)
            self.trainer.optimizers[0].add_param_group({"params": list(self.head.parameters())})

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        x, y = batch
        loss = self.criterion(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", self.criterion(self(x), y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", self.criterion(self(x), y), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        if self.feature == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)
        if self.feature == "lbfgs":  # its line search calls the closure up to 3 times a step
            return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=3)
        params = self.parameters()  # "unfreeze": the frozen layer is in the optimiser
        if self.feature == "add_param_group":  # ... here it joins later
            params = [p for p in params if p.requires_grad]
        opt = torch.optim.SGD(params, lr=0.2, momentum=0.9)
        if self.feature != "step_scheduler":
            return opt
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=STEPS)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def trainer_options(feature: str, tmp: str) -> dict[str, Any]:
    """The Trainer arguments that switch ``feature`` on (beyond the common ones)."""
    options: dict[str, Any] = {
        "accumulate_grad_batches": {"accumulate_grad_batches": 2},
        "clip_norm": {"gradient_clip_val": 0.05},
        "clip_value": {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"},
        "bf16_mixed": {"precision": "bf16-mixed"},
        "fp16_mixed_scaler": {"plugins": [MixedPrecision("16-mixed", "cpu")]},
        "sync_batchnorm": {"sync_batchnorm": True},
        "early_stopping": {
            "max_steps": -1, "max_epochs": 5,
            "callbacks": [EarlyStopping("train_loss", min_delta=10.0, patience=0)],
        },
        "resume_mid_epoch": {
            "max_steps": 2, "enable_checkpointing": True,
            "callbacks": [ModelCheckpoint(dirpath=tmp, filename="mid", every_n_train_steps=2,
                                          enable_version_counter=False)],
        },
        "fit_twice": {"max_steps": 2},
        "evaluate_after_fit": {"limit_val_batches": None},
    }.get(feature, {})  # fmt: skip
    if feature == "accumulate_grad_batches":
        options["max_steps"] = 2  # 4 batches
    return options


def make_trainer(strategy: Any, devices: int, feature: str, tmp: str, **extra: Any) -> pl.Trainer:
    kw: dict[str, Any] = {
        "max_steps": STEPS, "logger": False, "enable_checkpointing": False,
        "enable_progress_bar": False, "enable_model_summary": False,
        "use_distributed_sampler": False, "num_sanity_val_steps": 0, "limit_val_batches": 0,
    }  # fmt: skip
    kw.update(trainer_options(feature, tmp))
    kw.update(extra)
    kw = {k: v for k, v in kw.items() if v is not None}
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, **kw)


def _weights(trainer: pl.Trainer, model: pl.LightningModule) -> dict[str, Any]:
    """The full model's floating tensors (pipeline strategies gather them on rank 0)."""
    if torch.distributed.is_initialized():  # inside a rank: every rank must take part
        state = trainer.strategy.lightning_module_state_dict()
    else:  # a launch from here handed the trained model back
        state = model.state_dict()
    return {k: v.detach().float().numpy().copy() for k, v in state.items()
            if v.is_floating_point()}  # fmt: skip


def run_cell(strategy: Any, devices: int, feature: str, tmp: str, shards: bool) -> dict[str, Any]:
    """Train one cell; returns ``weights`` (full model, rank 0), ``metrics`` and
    ``warnings`` (messages), or ``error`` (the exception's text)."""
    make = strategy if callable(strategy) else (lambda: strategy)
    os.makedirs(tmp, exist_ok=True)
    model = Tiny(feature)
    model.shards = shards
    metrics: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer = make_trainer(make(), devices, feature, tmp)
            trainer.fit(model)
            if feature == "resume_mid_epoch":
                model = Tiny(feature)
                model.shards = shards
                trainer = make_trainer(make(), devices, feature, tmp, max_steps=STEPS,
                                       callbacks=[], enable_checkpointing=False)  # fmt: skip
                trainer.fit(model, ckpt_path=os.path.join(tmp, "mid.ckpt"))
            if feature == "fit_twice":
                trainer = make_trainer(make(), devices, feature, tmp)
                trainer.fit(model)
            if feature == "evaluate_after_fit":
                metrics["val_loss"] = trainer.validate(model, verbose=False)[0]["val_loss"]
                metrics["test_loss"] = trainer.test(model, verbose=False)[0]["test_loss"]
                predictions = trainer.predict(model)
                metrics["predictions"] = (
                    None if predictions is None else torch.cat(predictions).numpy().copy()
                )
            weights = _weights(trainer, model)
            saved = _saved(trainer, feature, weights, os.path.join(tmp, "after-fit.ckpt"))
        except Exception as err:  # the test compares the message with the table's
            return {"error": f"{type(err).__name__}: {err}"}
    return {
        "weights": weights,
        "metrics": metrics,
        "warnings": [str(w.message) for w in caught],
        "saved": saved,
    }


def _saved(trainer: pl.Trainer, feature: str, weights: dict[str, Any], path: str) -> str:
    """What a user does after ``fit``: ``save_checkpoint`` (in the script's process after a
    fork launch, in every rank otherwise) and ``load_from_checkpoint``. '' if the file holds
    the trained weights and the optimiser state, else what it lacks."""
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    loaded = Tiny.load_from_checkpoint(path, feature=feature).state_dict()
    for key, value in weights.items():
        for where, state in (("saved", checkpoint["state_dict"]), ("loaded", loaded)):
            if not np.allclose(state[key].float().numpy(), value, rtol=1e-6, atol=1e-7):
                return f"the {where} {key} is not the trained one"
    states = checkpoint.get("optimizer_states") or [{}]
    if trainer.state.fn == "fit" and not all(s.get("state") for s in states):
        return "the checkpoint holds no optimiser state"
    return ""


def cells_on_rank(rank: int, world: int, name: str, features: list[str], tmp: str) -> dict:
    """``run_on_ranks`` entry: every feature of ``features`` under strategy ``name``."""
    from lightning_par.strategies.registry import spec

    row = spec(name)
    shards = getattr(row.load(), "shards_data", True)
    out = {}
    for feature in features:
        out[feature] = run_cell(row.create, world, feature, os.path.join(tmp, feature), shards)
    return out


def _factory(name: str) -> tuple[Any, int, bool]:
    """(strategy factory, devices, reads a shard) for a strategy name or ``"one process"``."""
    if name == "one process":
        return (lambda: "auto"), 1, False
    from lightning_par.features import row as table_row
    from lightning_par.strategies.registry import spec

    made = spec(name)
    return made.create, table_row(name).devices, getattr(made.load(), "shards_data", True)


def write_checkpoint(name: str, path: str) -> None:
    """2 steps under ``name`` (of an epoch of 4), saved as ``path``/mid.ckpt."""
    make, devices, shards = _factory(name)
    model = Tiny("resume_mid_epoch")
    model.shards = shards
    make_trainer(make(), devices, "resume_mid_epoch", path).fit(model)


def resume(name: str, ckpt: str) -> dict[str, Any]:
    """Resume ``ckpt`` under ``name`` to step 4: the full model's weights, or the error."""
    make, devices, shards = _factory(name)
    model = Tiny("resume_mid_epoch")
    model.shards = shards
    trainer = make_trainer(make(), devices, "resume_mid_epoch", "", max_steps=STEPS,
                           callbacks=[], enable_checkpointing=False)  # fmt: skip
    try:
        trainer.fit(model, ckpt_path=ckpt)
        return {"weights": _weights(trainer, model), "metrics": {}}
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}


def checkpoints_on_rank(rank: int, world: int, names: list[str], tmp: str) -> None:
    for name in names:
        write_checkpoint(name, os.path.join(tmp, name))


def resumes_on_rank(rank: int, world: int, pairs: list[tuple[str, str]], tmp: str) -> dict:
    return {(src, dst): resume(dst, os.path.join(tmp, src, "mid.ckpt")) for src, dst in pairs}
