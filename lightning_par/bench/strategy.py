"""Step time of the allreduce strategies against Lightning's DDP (same run).

    python -m lightning_par.bench strategy --devices 2 --steps 30
    python -m lightning_par.bench strategy --devices 1 --rounds 3

Trains the CIFAR CNN on synthetic CIFAR-shaped data for a fixed number of steps with each
strategy (CPU, ranks started by the launch policy; Lightning's DDP is ``lightning_ddp``,
launched the same way) and reports the median step time of rank 0 after a warm-up, and
its ratio to the reference's (< 1: faster). At ``--devices 1`` the reference is Lightning's
``SingleDeviceStrategy`` and ``local_sgd`` runs too: every data-parallel plugin should cost
nothing at one process. ``--rounds R`` runs the candidates R times in alternating order and
pools their steps, so that a change in machine load hits all of them alike. The reference
is the peer: if its fit fails, its row says so (``failed``), the others are still timed and
their ratios are ``None`` (:mod:`._peers`).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader
from typing_extensions import override

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par.bench._environment import RunEnvironment, print_result
from lightning_par.bench._peers import attempt
from lightning_par.collectives import ALGORITHMS
from lightning_par.data import SyntheticCIFAR10
from lightning_par.models import CifarCNN
from lightning_par.strategies import reference_ddp
from lightning_par.strategies.allreduce import AllReduceStrategy
from lightning_par.strategies.local_sgd import LocalSGDStrategy


class StepTimer(pl.Callback):
    """Rank 0 writes its per-step wall times to ``path`` at the end of training."""

    def __init__(self, path: str) -> None:
        self.path, self.times, self._start = path, [], 0.0

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter() - self._start)

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            Path(self.path).write_text(json.dumps(self.times))


def run_one(strategy, args, path: str) -> tuple[list[float], str]:
    model = CifarCNN(width=args.width, num_blocks=args.num_blocks, scheduler=None)
    data = SyntheticCIFAR10(size=args.batch_size * args.devices * (args.steps + 1), seed=0)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=args.devices,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[StepTimer(path)],
    )
    trainer.fit(model, DataLoader(data, batch_size=args.batch_size))
    plan = getattr(trainer.strategy, "launch_plan", None)  # (none: Lightning's single device)
    return json.loads(Path(path).read_text()), plan.method if plan else "in-process"


def reference_and_candidates(args) -> dict:
    """Name -> strategy factory, the reference first: Lightning's DDP, or at one device
    Lightning's single-device strategy (with ``local_sgd`` added to the candidates)."""
    if args.devices == 1:
        candidates = {"lightning_single": lambda: SingleDeviceStrategy("cpu")}
    else:
        candidates = {"lightning_ddp": reference_ddp}
    for name in args.algorithms:
        candidates[f"{name}_allreduce"] = lambda name=name: AllReduceStrategy(
            algorithm=name, bucket_cap_mb=args.bucket_cap_mb
        )
    if args.devices == 1:
        candidates["local_sgd"] = lambda: LocalSGDStrategy(period=4)
    return candidates


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_par.bench strategy")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, default=4)
    parser.add_argument("--bucket-cap-mb", type=float, default=4.0)
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument(
        "--rounds", type=int, default=1, help="runs of every candidate, interleaved, pooled"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error("--steps must be larger than --warmup")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    warnings.filterwarnings("ignore", ".*val_dataloader.*|.*LeafSpec.*|.*many workers.*")
    # Lightning's info lines off for the run only: a caller in this process (a notebook, a
    # test) keeps its own level
    lightning_log = logging.getLogger("lightning.pytorch")
    level = lightning_log.level
    lightning_log.setLevel(logging.ERROR)
    try:
        started = RunEnvironment.now()
        result = run(args)
    finally:
        lightning_log.setLevel(level)
    print_result(result, report, args.json, started)
    return 0


def run(args) -> dict:
    """Every candidate's steps, the reference first (the peer: its failure is a row)."""
    candidates = reference_and_candidates(args)
    reference = next(iter(candidates))
    timed: dict[str, list[float]] = {name: [] for name in candidates}
    methods: dict[str, str] = {}
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = list(candidates) if round_ % 2 == 0 else list(candidates)[::-1]
            for name in order:
                if name in failed:
                    continue
                path = str(Path(tmp) / f"{name}.{round_}.json")
                fit = lambda name=name, path=path: run_one(candidates[name](), args, path)  # noqa: E731
                if name == reference:
                    ran, error = attempt(name, fit)
                    if error is not None:
                        failed[name] = error
                        continue
                else:
                    ran = fit()
                times, methods[name] = ran
                timed[name] += times[args.warmup :]
    rows = [{"strategy": name, "failed": error} for name, error in failed.items()]
    rows += [
        {
            "strategy": name,
            "workers": args.devices,
            "start_method": methods[name],
            "rounds": args.rounds,
            "steps_timed": len(times),
            "median_step_s": statistics.median(times),
            "min_step_s": min(times),
            "max_step_s": max(times),
        }  # fmt: skip
        for name, times in timed.items()
        if name not in failed
    ]
    ref = None if reference in failed else rows[0]["median_step_s"]
    for row in rows:
        if "failed" in row:
            continue
        row["reference"] = reference
        row["ratio_to_ddp"] = None if ref is None else row["median_step_s"] / ref  # (old name)
        row["speed_vs_reference"] = None if ref is None else ref / row["median_step_s"]
    setup = {k: getattr(args, k) for k in ("devices", "steps", "warmup", "batch_size", "width",
                                            "num_blocks")}  # fmt: skip
    return {**setup, "reference": reference, "rows": rows}


def report(result: dict) -> str:
    lines = [
        f"CifarCNN(width={result['width']}, num_blocks={result['num_blocks']}), batch "
        f"{result['batch_size']}/rank, {result['devices']} CPU processes, median of steps "
        f"{result['warmup']}..{result['steps'] - 1}",
        f"{'strategy':>24} {'step ms':>9} {'time vs ' + result['reference']:>24}",
    ]
    for r in result["rows"]:
        if "failed" in r:
            lines.append(f"{r['strategy']:>24} failed: {r['failed']}")
            continue
        ratio = "-" if r["ratio_to_ddp"] is None else f"{r['ratio_to_ddp']:.3f}"
        lines.append(f"{r['strategy']:>24} {r['median_step_s'] * 1e3:>9.1f} {ratio:>24}")
    return "\n".join(lines)
