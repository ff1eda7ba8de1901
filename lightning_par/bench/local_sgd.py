"""Local SGD against synchronous allreduce with a straggler, on real CIFAR-10 images.

    python -m lightning_par.bench local_sgd [--epochs 3] [--slowdowns 3,1] [--json]

Two CPU ranks train the CIFAR CNN on cifar10-mini (each on its half, Lightning's
``DistributedSampler``) for the same number of epochs, rank 1 made k times slower by
:class:`~lightning_par.callbacks.Straggler` (for each k of ``--slowdowns``; k = 1 is the
run without a straggler, for comparison), under each contender in one run:
``ring_allreduce`` (gradients averaged every step), ``local_sgd(period=4)`` and
``local_sgd(period=None)`` (weights averaged once per epoch, the course's ParallelSGD).
Reported per contender: training images per second over both ranks (images trained /
the slower rank's wall time from the start of training to the end of ``fit``), test
accuracy after the last epoch, bytes rank 0 sent during training, and how long the fast
rank 0 spent in communication (its trace: waiting for gradient buckets, or averaging).
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings
from collections.abc import Callable

import lightning.pytorch as pl
from typing_extensions import override

from lightning_par.bench._environment import RunEnvironment, print_result
from lightning_par.callbacks import Straggler
from lightning_par.comm import run_on_ranks
from lightning_par.data import CIFAR10DataModule
from lightning_par.models import CifarCNN
from lightning_par.strategies.allreduce import AllReduceStrategy
from lightning_par.strategies.local_sgd import LocalSGDStrategy

#: Contender name -> a new strategy (trace on: bytes and communication time come from it).
CONTENDERS: dict[str, Callable[[], pl.strategies.ParallelStrategy]] = {
    "ring_allreduce": lambda: AllReduceStrategy("ring", trace=True),
    "local_sgd(period=4)": lambda: LocalSGDStrategy(period=4, trace=True),
    "local_sgd(period=None)": lambda: LocalSGDStrategy(period=None, trace=True),
}
#: Trace spans that are communication a rank waits for, by strategy.
COMM_SPANS = ("wait for buckets", "average")


class TrainClock(pl.Callback):
    """Start time of training and images trained on this rank."""

    def __init__(self) -> None:
        self.start = 0.0
        self.images = 0

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        self.start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.images += len(batch[0])


def _trainer(strategy, args, callbacks: list, **kw) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=callbacks, **kw,
    )  # fmt: skip


def _rank(rank: int, world_size: int, runs: list[tuple[float, str]], args) -> list[dict]:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*|.*val_dataloader.*|.*Dis")
    rows = []
    for slowdown, name in runs:
        pl.seed_everything(args.seed, verbose=False)
        model = CifarCNN(width=args.width, num_blocks=args.num_blocks, lr=args.lr)
        data = CIFAR10DataModule(source="cifar10-mini", batch_size=args.batch_size)
        clock, strategy = TrainClock(), CONTENDERS[name]()
        straggler = Straggler(rank=1, slowdown=slowdown)
        _trainer(
            strategy, args, [straggler, clock], max_epochs=args.epochs,
            limit_train_batches=args.limit_batches,
        ).fit(model, datamodule=data)  # fmt: skip
        train_s = time.perf_counter() - clock.start
        trace = strategy.trace
        comm_s = sum(e.end - e.start for e in trace.events if e.name in COMM_SPANS)
        sent = trace.bytes_sent
        tester = _trainer(CONTENDERS[name](), args, [], limit_test_batches=args.limit_batches)
        (metrics,) = tester.test(model, datamodule=data, verbose=False)
        rows.append({
            "strategy": name, "slowdown": slowdown, "train_s": train_s, "images": clock.images,
            "comm_s": comm_s, "bytes_sent": sent, "test_acc": metrics["test_acc"],
            "test_loss": metrics["test_loss"],
        })  # fmt: skip
    return rows


def run(args) -> dict:
    runs = [(k, name) for k in args.slowdowns for name in CONTENDERS]
    fast, slow = run_on_ranks(_rank, 2, runs, args, timeout=args.timeout)
    rows = []
    for f, s in zip(fast, slow):
        wall = max(f["train_s"], s["train_s"])
        rows.append({
            "strategy": f["strategy"],
            "slowdown": f["slowdown"],
            "images_per_s": (f["images"] + s["images"]) / wall,
            "train_s": wall,
            "test_acc": f["test_acc"],
            "test_loss": f["test_loss"],
            "rank0_comm_s": f["comm_s"],
            "rank0_bytes_sent": f["bytes_sent"],
            "rank1_images": s["images"],
        })  # fmt: skip
    for row in rows:
        ring = next(r for r in rows if r["slowdown"] == row["slowdown"])  # ring comes first
        row["speedup_vs_ring"] = row["images_per_s"] / ring["images_per_s"]
    setup = {k: getattr(args, k) for k in ("epochs", "slowdowns", "width", "num_blocks",
                                            "batch_size", "lr", "seed")}  # fmt: skip
    return {"workers": 2, "straggler_rank": 1, "data": "cifar10-mini", **setup, "rows": rows}


def report(result: dict) -> str:
    lines = [
        f"CifarCNN(width={result['width']}, num_blocks={result['num_blocks']}), cifar10-mini, "
        f"2 CPU ranks, rank 1 k times slower (Straggler), {result['epochs']} epochs, "
        f"batch {result['batch_size']}/rank, lr {result['lr']:g}",
        "",
        "| k | strategy | images/s | vs ring | train s | test acc | rank 0 comm s "
        "| rank 0 MB sent |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['slowdown']:g} | {r['strategy']} | {r['images_per_s']:.0f} "
            f"| {r['speedup_vs_ring']:.2f}x "
            f"| {r['train_s']:.1f} | {r['test_acc']:.1%} | {r['rank0_comm_s']:.1f} "
            f"| {r['rank0_bytes_sent'] / 1e6:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_par.bench local_sgd")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--slowdowns", default="3,1", help="comma list of rank 1's Straggler k (1: none)"
    )
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--limit-batches", type=int, default=None, help="train/test batches per epoch (smoke test)"
    )
    parser.add_argument("--timeout", type=float, default=1200, help="seconds for the run")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    args.slowdowns = [float(k) for k in args.slowdowns.split(",")]
    if args.epochs < 1 or min(args.slowdowns) < 1:
        parser.error("--epochs must be >= 1 and every slowdown >= 1")
    started = RunEnvironment.now()
    result = run(args)
    print_result(result, report, args.json, started, indent=2)
    return 0
