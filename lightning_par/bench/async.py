"""Asynchronous SGD against the synchronous strategies under a straggler, on real CIFAR-10.

    python -m lightning_par.bench async [--epochs 8] [--seeds 0,1,2] [--slowdown 3] [--json]

Two CPU workers train :class:`~lightning_par.models.TinyCNN` on cifar10-mini for the same
number of epochs, worker 1 made k times slower by :class:`~lightning_par.callbacks.Straggler`,
under each contender, for each seed; the contenders run interleaved (seed by seed) so that
a change of machine load hits them alike, and each ratio compares runs of the same seed.
The default contenders: ``parameter_server`` (the reference), ``async_sgd`` (fully
asynchronous, with its default remedy: the servers' momentum at most 0.5) and
``async_sgd(plain)`` (no remedy: the model's momentum 0.9); the others
(each remedy alone, stale synchronous parallel, local SGD, ring allreduce) by name
with ``--strategies``. The synchronous strategies give each worker half of every epoch;
``async_sgd`` shares the epoch's batches on demand, so the fast worker takes more.

Reported per contender and seed: training images per second (images trained by both
workers / the wall time from the first worker's start of training to the last worker's
end), the images each worker trained, and the test accuracy of the final weights ``fit``
hands back (tested in this process on the 1 017 test images); per contender the mean over
the seeds and the spread (min, max). SGD with momentum, cosine learning rate over the
epochs (an epoch's schedule is the same for asynchronous workers, a step's is not); an
asynchronous update applies one worker's batch, a synchronous one the mean of both, so the
asynchronous rows use ``lr x --async-lr-scale`` (1/W: the same step per image).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
from typing_extensions import override

from lightning_par.bench._environment import RunEnvironment, print_result
from lightning_par.callbacks import Straggler
from lightning_par.data import CIFAR10DataModule
from lightning_par.models import TinyCNN
from lightning_par.strategies.allreduce import AllReduceStrategy
from lightning_par.strategies.async_sgd import AsyncSGDStrategy
from lightning_par.strategies.local_sgd import LocalSGDStrategy
from lightning_par.strategies.parameter_server import ParameterServerStrategy

PLAIN = {"staleness_lr": False, "dc_lambda": 0.0, "momentum": None}

#: Contender name -> a new strategy.
CONTENDERS: dict[str, Callable[[], pl.strategies.ParallelStrategy]] = {
    "parameter_server": lambda: ParameterServerStrategy(),
    "async_sgd": lambda: AsyncSGDStrategy(),
    "async_sgd(plain)": lambda: AsyncSGDStrategy(**PLAIN),
    "async_sgd(staleness_lr)": lambda: AsyncSGDStrategy(**{**PLAIN, "staleness_lr": True}),
    "async_sgd(dc)": lambda: AsyncSGDStrategy(
        **{**PLAIN, "dc_lambda": 2.0, "dc_mean_square": 0.95}
    ),
    "async_sgd(momentum=0.5)": lambda: AsyncSGDStrategy(**{**PLAIN, "momentum": 0.5}),
    "async_sgd(momentum=0.8)": lambda: AsyncSGDStrategy(**{**PLAIN, "momentum": 0.8}),
    "async_sgd(staleness=1)": lambda: AsyncSGDStrategy(staleness=1),
    "async_sgd(staleness=4)": lambda: AsyncSGDStrategy(staleness=4),
    "local_sgd(period=4)": lambda: LocalSGDStrategy(period=4),
    "ring_allreduce": lambda: AllReduceStrategy("ring"),
}
DEFAULT = "parameter_server,async_sgd,async_sgd(plain)"


class TrainClock(pl.Callback):
    """Writes this rank's training start and end (wall clock) and images to ``out``."""

    def __init__(self, out: Path) -> None:
        self.out, self.start, self.images = out, 0.0, 0

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        self.start = time.time()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.images += len(batch[0])

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        record = {"start": self.start, "end": time.time(), "images": self.images}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def fit_one(name: str, seed: int, args, root: Path) -> dict:
    pl.seed_everything(seed, verbose=False)
    asynchronous = name.startswith("async_sgd") and name != "async_sgd(staleness=0)"
    lr = args.lr * (args.async_lr_scale if asynchronous else 1.0)
    model = TinyCNN(width=args.width, lr=lr, momentum=args.momentum, scheduler="cosine")
    data = CIFAR10DataModule(source="cifar10-mini", batch_size=args.batch_size, seed=0)
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
        "seed": seed, "train_s": wall, "images_per_s": sum(images) / wall,
        "rank_images": images, "test_acc": metrics["test_acc"],
        "test_loss": metrics["test_loss"],
    }  # fmt: skip


def summarise(name: str, runs: list[dict], ref: list[dict], ref_name: str) -> dict:
    """Mean and spread over the seeds; each ratio against the reference run of its seed."""
    speedups = [r["images_per_s"] / q["images_per_s"] for r, q in zip(runs, ref)]
    points = [100 * (r["test_acc"] - q["test_acc"]) for r, q in zip(runs, ref)]
    accs = [r["test_acc"] for r in runs]
    return {
        "strategy": name,
        "images_per_s": statistics.mean(r["images_per_s"] for r in runs),
        "train_s": statistics.mean(r["train_s"] for r in runs),
        "test_acc": statistics.mean(accs), "test_acc_min": min(accs), "test_acc_max": max(accs),
        "test_loss": statistics.mean(r["test_loss"] for r in runs),
        "rank_images": [round(statistics.mean(r["rank_images"][k] for r in runs)) for k in (0, 1)],
        f"speedup_vs_{ref_name}": statistics.mean(speedups),
        f"speedup_vs_{ref_name}_min": min(speedups),
        f"acc_points_vs_{ref_name}": statistics.mean(points),
        f"acc_points_vs_{ref_name}_min": min(points),
        f"acc_points_vs_{ref_name}_max": max(points),
        "seeds": runs,
    }  # fmt: skip


def run(args) -> dict:
    # one worker per core: the loaders read in the training process, as they should here
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    runs: dict[str, list[dict]] = {name: [] for name in args.strategies}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for i, name in enumerate(args.strategies):
                runs[name].append(fit_one(name, seed, args, Path(tmp) / f"{seed}-{i}"))
    ref = args.strategies[0]
    rows = [summarise(name, runs[name], runs[ref], ref) for name in args.strategies]
    keys = ("epochs", "slowdown", "width", "batch_size", "lr", "momentum", "async_lr_scale",
            "seeds")  # fmt: skip
    setup = {k: getattr(args, k) for k in keys}
    return {"workers": 2, "straggler_rank": 1, "data": "cifar10-mini", "model": "TinyCNN",
            **setup, "rows": rows}  # fmt: skip


def report(result: dict) -> str:
    ref = result["rows"][0]["strategy"]
    lines = [
        f"TinyCNN(width={result['width']}), cifar10-mini, 2 CPU workers, worker 1 "
        f"{result['slowdown']:g}x slower (Straggler), {result['epochs']} epochs, batch "
        f"{result['batch_size']}, SGD lr {result['lr']:g} (async_sgd: x"
        f"{result['async_lr_scale']:g}) momentum {result['momentum']:g}, cosine; seeds "
        f"{result['seeds']} (mean [min, max])",
        "",
        f"| strategy | images/s | vs {ref} | images (w0, w1) | test acc | acc vs {ref} |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['strategy']} | {r['images_per_s']:.0f} | {r['speedup_vs_' + ref]:.2f}x "
            f"(min {r['speedup_vs_' + ref + '_min']:.2f}x) "
            f"| {r['rank_images'][0]}, {r['rank_images'][1]} "
            f"| {r['test_acc']:.1%} [{r['test_acc_min']:.1%}, {r['test_acc_max']:.1%}] "
            f"| {r['acc_points_vs_' + ref]:+.1f} pts [{r['acc_points_vs_' + ref + '_min']:+.1f}, "
            f"{r['acc_points_vs_' + ref + '_max']:+.1f}] |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_par.bench async")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--seeds", default="0,1,2", help="comma list of seeds")
    parser.add_argument("--slowdown", type=float, default=3.0, help="worker 1's Straggler k")
    parser.add_argument("--strategies", default=DEFAULT,
                        help="comma list (see CONTENDERS); the first is the reference")  # fmt: skip
    parser.add_argument("--width", type=int, default=16, help="TinyCNN's first conv channels")
    parser.add_argument("--batch-size", type=int, default=32, help="per worker and step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--async-lr-scale", type=float, default=0.5,
                        help="async_sgd's lr is --lr times this (1/W by default)")  # fmt: skip
    parser.add_argument(
        "--limit-batches", type=int, default=None, help="train/test batches per epoch (smoke test)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    args.strategies = args.strategies.split(",")
    try:
        args.seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds must be a comma list of whole numbers, got {args.seeds!r}")
    unknown = [s for s in args.strategies if s not in CONTENDERS]
    if unknown or args.epochs < 1 or args.slowdown < 1:
        parser.error(f"unknown strategies {unknown}; choose from {list(CONTENDERS)}; "
                     "--epochs >= 1, --slowdown >= 1")  # fmt: skip
    started = RunEnvironment.now()
    result = run(args)
    print_result(result, report, args.json, started)
    return 0
