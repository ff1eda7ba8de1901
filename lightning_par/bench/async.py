"""Asynchronous SGD against the synchronous strategies under a straggler, on real CIFAR-10.

    python -m lightning_par.bench async [--epochs 3] [--slowdown 3] [--json]

Two CPU workers train the CIFAR CNN on cifar10-mini for the same number of epochs, worker
1 made k times slower by :class:`~lightning_par.callbacks.Straggler`, under each contender
in one run: ``parameter_server``, ``async_sgd`` (fully asynchronous),
``async_sgd(staleness=1)`` and ``(staleness=4)`` (stale synchronous parallel),
``local_sgd(period=4)`` and ``ring_allreduce``. The synchronous strategies give each worker
half of every epoch (Lightning's ``DistributedSampler``); ``async_sgd`` shares the epoch's
batches on demand, so the fast worker takes more of them.

Reported per contender: training images per second (images trained by both workers in the
epochs / the wall time from the first worker's start of training to the last worker's end),
the images each worker trained, and test accuracy after the last epoch (the final weights
that ``fit`` hands back, tested in this process on the 1 017 test images). SGD with
momentum at a constant learning rate: a per-step schedule advances by each worker's own
steps, which differ between asynchronous workers.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl

from lightning_par.callbacks import Straggler
from lightning_par.data import CIFAR10DataModule
from lightning_par.models import CifarCNN
from lightning_par.strategies.allreduce import AllReduceStrategy
from lightning_par.strategies.async_sgd import AsyncSGDStrategy
from lightning_par.strategies.local_sgd import LocalSGDStrategy
from lightning_par.strategies.parameter_server import ParameterServerStrategy

#: Contender name -> a new strategy; the first is the reference of the ratios.
CONTENDERS: dict[str, Callable[[], pl.strategies.ParallelStrategy]] = {
    "parameter_server": lambda: ParameterServerStrategy(),
    "async_sgd": lambda: AsyncSGDStrategy(),
    "async_sgd(staleness=1)": lambda: AsyncSGDStrategy(staleness=1),
    "async_sgd(staleness=4)": lambda: AsyncSGDStrategy(staleness=4),
    "local_sgd(period=4)": lambda: LocalSGDStrategy(period=4),
    "ring_allreduce": lambda: AllReduceStrategy("ring"),
}


class TrainClock(pl.Callback):
    """Writes this rank's training start and end (wall clock) and images to ``out``."""

    def __init__(self, out: Path) -> None:
        self.out, self.start, self.images = out, 0.0, 0

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = time.time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.images += len(batch[0])

    def on_train_end(self, trainer, pl_module) -> None:
        record = {"start": self.start, "end": time.time(), "images": self.images}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def fit_one(name: str, args, root: Path) -> dict:
    pl.seed_everything(args.seed, verbose=False)
    # an asynchronous update is one worker's batch, a synchronous one the mean of W: at
    # --async-lr-scale 1/W both move the weights by the same amount per image
    asynchronous = name.startswith("async_sgd")
    lr = args.lr * (args.async_lr_scale if asynchronous else 1.0)
    momentum = args.async_momentum if asynchronous else 0.9
    model = CifarCNN(width=args.width, num_blocks=args.num_blocks, lr=lr, momentum=momentum,
                     scheduler=None)  # fmt: skip
    data = CIFAR10DataModule(source="cifar10-mini", batch_size=args.batch_size)
    root.mkdir()
    pl.Trainer(
        strategy=CONTENDERS[name](), accelerator="cpu", devices=2, max_epochs=args.epochs,
        limit_train_batches=args.limit_batches, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Straggler(rank=1, slowdown=args.slowdown), TrainClock(root)],
    ).fit(model, datamodule=data)  # fmt: skip
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]
    tester = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_test_batches=args.limit_batches,
    )  # fmt: skip
    (metrics,) = tester.test(model, datamodule=data, verbose=False)
    wall = max(r["end"] for r in ranks) - min(r["start"] for r in ranks)
    images = [r["images"] for r in ranks]
    return {
        "strategy": name, "train_s": wall, "images_per_s": sum(images) / wall,
        "rank_images": images, "test_acc": metrics["test_acc"],
        "test_loss": metrics["test_loss"],
    }  # fmt: skip


def run(args) -> dict:
    warnings.filterwarnings("ignore", ".*does not have many workers.*|.*val_dataloader.*")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(args.strategies):
            rows.append(fit_one(name, args, Path(tmp) / str(i)))
    ref = rows[0]
    for row in rows:
        row["speedup_vs_" + ref["strategy"]] = row["images_per_s"] / ref["images_per_s"]
        row["acc_points_vs_" + ref["strategy"]] = 100 * (row["test_acc"] - ref["test_acc"])
    keys = ("epochs", "slowdown", "width", "num_blocks", "batch_size", "lr", "async_lr_scale",
            "async_momentum", "seed")  # fmt: skip
    setup = {k: getattr(args, k) for k in keys}
    return {"workers": 2, "straggler_rank": 1, "data": "cifar10-mini", **setup, "rows": rows}


def report(result: dict) -> str:
    ref = result["rows"][0]["strategy"]
    lines = [
        f"CifarCNN(width={result['width']}, num_blocks={result['num_blocks']}), cifar10-mini, "
        f"2 CPU workers, worker 1 {result['slowdown']:g}x slower (Straggler), "
        f"{result['epochs']} epochs, batch {result['batch_size']}, lr {result['lr']:g} "
        f"(async_sgd: x{result['async_lr_scale']:g}, momentum {result['async_momentum']:g})",
        "",
        f"| strategy | images/s | vs {ref} | train s | images (w0, w1) | test acc | acc vs {ref} |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['strategy']} | {r['images_per_s']:.0f} | {r['speedup_vs_' + ref]:.2f}x "
            f"| {r['train_s']:.1f} | {r['rank_images'][0]}, {r['rank_images'][1]} "
            f"| {r['test_acc']:.1%} | {r['acc_points_vs_' + ref]:+.1f} pts |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_par.bench async")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--slowdown", type=float, default=3.0, help="worker 1's Straggler k")
    parser.add_argument("--strategies", default=",".join(CONTENDERS),
                        help="comma list; the first is the reference")  # fmt: skip
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker and step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--async-lr-scale", type=float, default=0.5,
                        help="async_sgd's lr is --lr times this (1/W by default)")  # fmt: skip
    parser.add_argument("--async-momentum", type=float, default=0.9,
                        help="async_sgd's momentum (the others: 0.9)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--limit-batches", type=int, default=None, help="train/test batches per epoch (smoke test)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    args.strategies = args.strategies.split(",")
    unknown = [s for s in args.strategies if s not in CONTENDERS]
    if unknown or args.epochs < 1 or args.slowdown < 1:
        parser.error(f"unknown strategies {unknown}; choose from {list(CONTENDERS)}; "
                     "--epochs >= 1, --slowdown >= 1")  # fmt: skip
    result = run(args)
    print(json.dumps(result) if args.json else report(result))
    return 0
