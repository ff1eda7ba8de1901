"""Running rows: one ``Trainer.fit`` per strategy, each rank probed.

The rows run one after the other in one subprocess (``python -m lightning_par.measure``), as
:mod:`lightning_par.check` runs its rows: start-up paid once, ranks through a clean
forkserver, each row under :func:`~lightning_par.launch.processes.time_limit`, after which its
ranks are stopped. A row that takes the subprocess down is reported as failed and the rows
after it go on in a fresh one (:func:`run_all`, under
:func:`~lightning_par.launch.processes.run_bounded`).

On every rank :class:`~.probe.Probe` writes ``probe/rank<N>.json``; the strategy's own trace
goes to ``trace/``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from lightning_par.launch.processes import run_bounded, time_limit
from lightning_par.measure.probe import Probe
from lightning_par.models import CifarCNN, CifarRNN, ResNet18

RESULT_TAG = "MEASURE_RESULT "
MODELS = ("CifarCNN", "CifarRNN", "resnet18")
#: One sample of what the rows train on: a CIFAR-10 image.
CIFAR_SAMPLE = (3, 32, 32)


def make_model(name: str) -> pl.LightningModule:
    """The compared model: small, so that every strategy finishes in seconds on a CPU."""
    if name == "resnet18":  # torchvision's, as it comes: cut from its traced graph
        return ResNet18(scheduler=None)
    if name == "CifarCNN":
        return CifarCNN(width=16, num_blocks=2, scheduler=None)
    if name == "CifarRNN":
        return CifarRNN(hidden_size=64)
    raise ValueError(f"unknown model {name!r}; choose one of {MODELS}")


def sample_shape(model: nn.Module) -> tuple[int, ...]:
    """One input sample's shape: ``model.example_input_array``'s where the model has one,
    else a CIFAR-10 image's (what the rows feed every model)."""
    example = getattr(model, "example_input_array", None)
    return tuple(example.shape[1:]) if isinstance(example, torch.Tensor) else CIFAR_SAMPLE


def describe_model(name: str) -> str:
    """``CifarCNN(width=16, num_blocks=2), 23,210 parameters`` (for the report's title)."""
    model = make_model(name)
    args = {"CifarCNN": "width=16, num_blocks=2", "CifarRNN": "hidden_size=64",
            "resnet18": "torchvision, GroupNorm"}[name]  # fmt: skip
    return f"{name}({args}), {sum(p.numel() for p in model.parameters()):,} parameters"


def data_replicas(strategy: Any) -> int:
    """How many ranks read different samples: the data-parallel degree."""
    if not getattr(strategy, "shards_data", True):
        return 1
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("num_replicas", 1))


class InOrder(pl.LightningDataModule):
    """The training set in file order, unshuffled, each data-parallel rank ``r`` of ``R``
    reading samples ``r, r + R, ...``: every strategy's step ``k`` sees the same global batch
    as one process would (Lightning's own sampler would shuffle), so the synchronous
    strategies must end with the same loss."""

    def __init__(self, dataset: Any, batch_size: int) -> None:
        super().__init__()
        self.dataset, self.batch_size = dataset, batch_size

    @override
    def train_dataloader(self) -> DataLoader:
        strategy = self.trainer.strategy
        sampler = None
        if data_replicas(strategy) > 1:
            sampler = DistributedSampler(
                self.dataset, shuffle=False, **strategy.distributed_sampler_kwargs
            )
        return DataLoader(self.dataset, batch_size=self.batch_size, sampler=sampler)


def run_row(row: dict, folder: str) -> dict:
    """Train ``row['model']`` under ``row['name']`` (with ``row['options']``; an older row:
    ``row['strategy']``) for ``row['steps']`` steps at global batch ``row['global_batch']``;
    probes and traces go to ``folder``."""
    import lightning_par  # noqa: F401  (registers the strategy names)
    from lightning_par.data import CIFAR10DataModule
    from lightning_par.strategies.registry import spec

    pl.seed_everything(0, verbose=False)
    folder_path = Path(folder)
    made, options = spec(row.get("name", row["strategy"])), row.get("options", {})
    try:
        strategy = made.create(trace_dir=str(folder_path / "trace"), **options)
    except TypeError:  # a strategy without the trace option: timed, not traced
        strategy = made.create(**options)
    trainer = pl.Trainer(
        strategy=strategy, accelerator=row["accelerator"], devices=row["devices"],
        max_steps=row["steps"], limit_val_batches=0, num_sanity_val_steps=0,
        use_distributed_sampler=False,  # InOrder shards the data itself
        callbacks=[Probe(folder_path / "probe")], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    replicas = data_replicas(trainer.strategy)
    if row["global_batch"] % replicas:
        raise ValueError(
            f"global batch {row['global_batch']} does not split over {replicas} data-parallel "
            f"ranks of {row['strategy']}: pick a --batch-size divisible by {replicas}"
        )
    per_rank = row["global_batch"] // replicas
    size = row["global_batch"] * (row["steps"] + 1)
    data = CIFAR10DataModule(source=row["source"], val_size=0, synthetic_size=size, augment=False)
    data.setup("fit")
    trainer.fit(make_model(row["model"]), datamodule=InOrder(data.train_set, per_rank))
    return {
        "data_replicas": replicas,
        "servers": int(getattr(trainer.strategy, "num_servers", 0) or 0),
        "start_method": getattr(getattr(trainer.strategy, "launch_plan", None), "method", None),
        # which source, not where it lies on this machine (the report is shared)
        "data": data.hparams.source,
    }


def run_rows(rows: list[dict], timeout: float) -> int:
    """In the rows' subprocess: each row under ``timeout`` seconds, one result line each."""
    os.environ.setdefault("LIGHTNING_PAR_START_METHOD", "forkserver")
    for row in rows:
        start = time.perf_counter()
        try:
            message = f"timed out after {timeout:.0f} s; every process of the row was killed"
            with time_limit(timeout, message):
                result = run_row(row, row["folder"])
        except Exception as err:  # this row failed; the others still run
            result = {"error": f"{type(err).__name__}: {err}".splitlines()[0][:300]}
        result.update(index=row["index"], seconds=round(time.perf_counter() - start, 1))
        print(RESULT_TAG + json.dumps(result), flush=True)
    return 0


def run_all(rows: list[dict], timeout: float) -> dict[int, dict]:
    """Every row, in as few subprocesses as crashes allow; results by row index."""
    results: dict[int, dict] = {}
    todo = list(rows)
    while todo:
        cmd = [sys.executable, "-m", "lightning_par.measure", "--timeout", str(timeout),
               json.dumps(todo)]  # fmt: skip
        proc = run_bounded(cmd, timeout * len(todo) + 120)
        for line in proc.stdout.splitlines():
            if line.startswith(RESULT_TAG):
                found = json.loads(line[len(RESULT_TAG) :])
                results[found.pop("index")] = found
        left = [r for r in todo if r["index"] not in results]
        if left:  # the first unreported row took the subprocess down
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            reason = "timed out" if proc.timed_out else tail[0][:300]
            results[left[0]["index"]] = {"error": f"the row's process died: {reason}"}
            left = left[1:]
        todo = left
    return results
