"""The script ``bench faults`` runs, as a user's: ``python -m lightning_par.bench._faults_run
WORLD STEPS FAULT EVERY MODEL FOLDER CASE[,CASE...] APPROACH[,APPROACH...] [LOST]``
(``LOST``: ``last``, the default, or ``first``: the rank the fault strikes), Lightning
choosing the launch or under torchrun.

``CASE``: ``strategy:lost``, a row of :data:`~lightning_par.bench._faults_cases.CASES` (its
options added to the strategy's). For each case, one ``fit`` per ``APPROACH``, one after the
other in this process (as cells of a notebook), each in ``FOLDER/CASE/APPROACH``
(:attr:`~lightning_par.bench._faults_cases.FaultCase.folder`):

* ``reference``: the strategy as it is, no fault: the weights the others are compared with;
* ``fault_tolerant``: its ``fault_tolerant=True``, the case's fault
  (``LIGHTNING_PAR_FAULT``) as step ``FAULT`` begins;
* ``restart``: the strategy as it is, a checkpoint every ``EVERY`` steps, the same fault;
* ``resume``: ``restart`` again from its newest checkpoint, no fault (in ``restart``'s
  folder: the script run again, as TorchElastic would).

Each fit begins with a line ``FIT CASE APPROACH`` on stderr, and one that raises says
``RAISED`` there. Rank 0 appends one JSON line per finished optimiser step to
``steps.jsonl`` (``{"step", "t"}``, wall time) and, at the end, the fault-tolerance events
(``{"event", "t"}``), or ``ended`` when it raises; a fit that ends normally saves rank 0's
parameters to ``weights.pt``.
The CIFAR CNN (``MODEL``: ``WIDTH,BLOCKS,BATCH``, its width and residual blocks and the
batch per rank) trains on cifar10-mini (or synthetic images, with
``LIGHTNING_PAR_BENCH_SYNTHETIC=1``) without random augmentation (a lost rank's batches read
again by another process would be cropped and flipped by that process's random numbers, and
its weights compared with none), Lightning choosing the launch.
"""

import json
import os
import sys
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_par.bench._faults_cases import FaultCase, case_named
from lightning_par.data import CIFAR10DataModule
from lightning_par.launch.faults import FAULT_ENV
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
        strategy = trainer.strategy
        tolerance = getattr(getattr(strategy, "resilience", None), "tolerance", None)
        stand_in = getattr(strategy, "stand_in", None)  # (the parameter server's lost workers)
        events = [*getattr(tolerance, "events", []), *getattr(stand_in, "events", [])]
        for event, t in events:
            self._write(trainer, {"event": event, "t": t})


def fit(case: FaultCase, world: int, approach: str, steps: int, every: int, model: str,
        folder: str) -> None:  # fmt: skip
    """One fit of ``approach`` (module docstring), its files in ``folder``."""
    row = spec(case.strategy)
    options = dict(row.options, **case.options, dead_peer_timeout=5.0)
    if approach == "fault_tolerant":
        options["fault_tolerant"] = True
    callbacks: list[pl.Callback] = [StepClock(os.path.join(folder, "steps.jsonl"))]
    checkpoints = os.path.join(folder, "checkpoints")
    if approach in ("restart", "resume"):
        callbacks.append(
            ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=every, save_last=True)
        )
    synthetic = os.environ.get("LIGHTNING_PAR_BENCH_SYNTHETIC") == "1"
    width, blocks, batch = (int(n) for n in model.split(","))
    source = "synthetic" if synthetic else "cifar10-mini"
    data = CIFAR10DataModule(source=source, batch_size=batch, augment=False)
    trainer = pl.Trainer(
        strategy=row.cls(**options), accelerator="cpu", devices=world, max_steps=steps,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=approach in ("restart", "resume"), callbacks=callbacks,
        limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    pl.seed_everything(0, verbose=False)
    ckpt = os.path.join(checkpoints, "last.ckpt") if approach == "resume" else None
    network = CifarCNN(width=width, num_blocks=blocks)
    trainer.fit(network, data, ckpt_path=ckpt)
    if trainer.is_global_zero:  # (under popen every rank runs this script)
        weights = {name: p.detach().clone() for name, p in network.named_parameters()}
        torch.save(weights, os.path.join(folder, "weights.pt"))


def ended(out: str) -> None:
    """Note when a fit ended with an error (the restart's time lost stops there until the
    script is run again)."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        with open(out, "a", encoding="utf-8") as f:
            f.write(json.dumps({"event": "ended", "t": time.time()}) + "\n")


def main(world: int, steps: int, fault: int, every: int, model: str, folder: str,
         cases: list[FaultCase], approaches: list[str], lost: str = "last") -> None:  # fmt: skip
    for case in cases:
        for approach in approaches:
            # (read by the strategies' constructors and by the parameter servers they start)
            struck = approach in ("fault_tolerant", "restart")
            strike = case.fault(world, fault, first_rank=lost == "first")
            os.environ[FAULT_ENV] = strike if struck else ""
            own = os.path.join(folder, case.folder, "restart" if approach == "resume" else approach)
            os.makedirs(own, exist_ok=True)
            if os.environ.get("LOCAL_RANK", "0") == "0":  # (popen: not in the re-run script)
                print(f"FIT {case.name} {approach}", file=sys.stderr, flush=True)
            try:
                fit(case, world, approach, steps, every, model, own)
            except Exception as err:  # (the restart's first fit ends so, with the lost rank)
                ended(os.path.join(own, "steps.jsonl"))
                print(f"RAISED {type(err).__name__}: {[*str(err).splitlines(), ''][0]}",
                      file=sys.stderr, flush=True)  # fmt: skip


if __name__ == "__main__":
    world, steps, fault, every, model, folder, cases, approaches = sys.argv[1:9]
    main(int(world), int(steps), int(fault), int(every), model, folder,
         [case_named(name) for name in cases.split(",")], approaches.split(","),
         *sys.argv[9:10])  # fmt: skip
