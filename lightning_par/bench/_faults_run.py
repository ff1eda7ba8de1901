"""One run of ``bench faults``, as a user's script: ``python -m lightning_par.bench._faults_run
PLUGIN WORLD APPROACH STEPS EVERY MODEL OUT [RESUME]``.

``APPROACH``: ``fault_tolerant`` (the plugin's ``fault_tolerant=True``) or ``restart`` (the
plugin as it is, a checkpoint every ``EVERY`` steps, run again from the newest one
with ``RESUME`` = ``resume``). The fault comes from ``LIGHTNING_PAR_FAULT`` in the
environment. Rank 0 appends one JSON line per finished optimiser step to ``OUT``
(``{"step", "t"}``, wall time) and, at the end, the fault-tolerance events
(``{"event", "t"}``). The CIFAR CNN (``MODEL``: ``WIDTH,BLOCKS,BATCH``, its width and
residual blocks and the batch per rank) trains on cifar10-mini (or synthetic images, with
``LIGHTNING_PAR_BENCH_SYNTHETIC=1``), Lightning choosing the launch.
"""

from __future__ import annotations

import json
import os
import sys
import time

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_par.data import CIFAR10DataModule
from lightning_par.models import CifarCNN
from lightning_par.strategies.registry import spec


class StepClock(pl.Callback):
    """Rank 0 appends each finished step's wall time to ``out`` (one JSON line each)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def _write(self, trainer: pl.Trainer, row: dict) -> None:
        if trainer.is_global_zero:
            with open(self.out, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._write(trainer, {"step": trainer.global_step, "t": time.time()})

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        resilience = getattr(trainer.strategy, "resilience", None)
        for event, t in getattr(getattr(resilience, "tolerance", None), "events", []):
            self._write(trainer, {"event": event, "t": t})


def main(
    plugin: str, world: int, approach: str, steps: int, every: int, model: str, out: str,
    resume: bool,
) -> None:  # fmt: skip
    row = spec(plugin)
    options = dict(row.options, dead_peer_timeout=5.0)
    if approach == "fault_tolerant":
        options["fault_tolerant"] = True
    callbacks: list[pl.Callback] = [StepClock(out)]
    folder = os.path.join(os.path.dirname(os.path.abspath(out)), f"ckpt-{plugin}-{world}")
    if approach == "restart":
        callbacks.append(ModelCheckpoint(dirpath=folder, every_n_train_steps=every, save_last=True))
    synthetic = os.environ.get("LIGHTNING_PAR_BENCH_SYNTHETIC") == "1"
    width, blocks, batch = (int(n) for n in model.split(","))
    source = "synthetic" if synthetic else "cifar10-mini"
    data = CIFAR10DataModule(source=source, batch_size=batch)
    trainer = pl.Trainer(
        strategy=row.cls(**options), accelerator="cpu", devices=world, max_steps=steps,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=approach == "restart", callbacks=callbacks,
        limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    pl.seed_everything(0, verbose=False)
    ckpt = os.path.join(folder, "last.ckpt") if resume else None
    try:
        trainer.fit(CifarCNN(width=width, num_blocks=blocks), data, ckpt_path=ckpt)
    except Exception as err:  # the restart approach's first run ends with the lost rank
        print(f"RAISED {type(err).__name__}: {str(err).splitlines()[0]}", flush=True)


if __name__ == "__main__":
    plugin, world, approach, steps, every, model, out = sys.argv[1:8]
    resume = sys.argv[8:] == ["resume"]
    main(plugin, int(world), approach, int(steps), int(every), model, out, resume)
