"""Images per second of a Lightning fit fed by ``CIFAR10DataModule(on_device=True)`` against
a plain torch loop over the same device batches and the same model (same run).

    python -m lightning_par.bench data [--device cpu|cuda] [--steps 40] [--rounds 3]

Both train ``CifarCNN`` with its own optimiser on cifar10-mini: the loop draws batches from
the same :class:`~lightning_par.data.device.DeviceBatches` (per-image crop and flip,
normalisation, all on the device) and runs forward, backward and step; Lightning runs the
same through ``Trainer.fit`` (single device, no logger, progress bar or checkpoints). A step's
time runs from the end of the previous step to the end of this one, so it includes making
the batch. The rounds alternate the order of the two; each figure is the median step over
all rounds after ``--warmup`` steps per round. Goal: Lightning at >= 0.95x the loop on CPU,
>= 0.8x on a GPU. The plain loop is the peer: if it fails, its row says so (``failed``) and
Lightning's is still timed (:mod:`._peers`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_par.bench._environment import RunEnvironment, print_result
from lightning_par.bench._peers import attempt
from lightning_par.data import CIFAR10DataModule
from lightning_par.data.device import DeviceBatches
from lightning_par.models import CifarCNN

#: The plain torch loop: a failure is its row
PEER = "torch_loop"


class StepClock(pl.Callback):
    """Seconds between the ends of consecutive training steps."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._last = 0.0

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        self._last = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._sync(pl_module.device)
        now = time.perf_counter()
        self.times.append(now - self._last)
        self._last = now

    @staticmethod
    def _sync(device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def _model(args) -> CifarCNN:
    torch.manual_seed(0)
    return CifarCNN(width=args.width, num_blocks=args.num_blocks, scheduler=None)


def plain_loop(args, batches: DeviceBatches, device: torch.device) -> list[float]:
    model = _model(args).to(device)
    opt = model.configure_optimizers()
    times, last = [], time.perf_counter()
    it = iter(batches)
    for _ in range(args.steps):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(batches)
            x, y = next(it)
        opt.zero_grad()
        model.criterion(model(x), y).backward()
        opt.step()
        StepClock._sync(device)
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times


def lightning_fit(args, data: CIFAR10DataModule, device: torch.device) -> list[float]:
    clock = StepClock()
    pl.Trainer(
        accelerator=device.type, devices=1, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=[clock],
    ).fit(_model(args), datamodule=data)  # fmt: skip
    return clock.times


def run(args) -> dict:
    device = torch.device(args.device)
    data = CIFAR10DataModule(source="cifar10-mini", batch_size=args.batch_size, on_device=True)
    data.setup("fit")
    subset = data.train_set
    index = torch.as_tensor(subset.indices)
    images = subset.base.images[index].to(device)
    labels = torch.as_tensor(subset.base.labels)[index].to(device)
    batches = DeviceBatches(images, labels, args.batch_size, seed=data.hparams.seed)
    candidates = {
        "torch_loop": lambda: plain_loop(args, batches, device),
        "lightning_on_device": lambda: lightning_fit(args, data, device),
    }
    steps: dict[str, list[float]] = {name: [] for name in candidates}
    failed: dict[str, str] = {}
    for round_ in range(args.rounds):
        order = list(candidates) if round_ % 2 == 0 else list(candidates)[::-1]
        for name in order:
            if name in failed:
                continue
            if name == PEER:
                times, error = attempt(name, candidates[name])
                if error is not None:
                    failed[name] = error
                    continue
            else:
                times = candidates[name]()
            steps[name] += times[args.warmup :]
    rows = [{"runner": name, "device": str(device), "failed": error}
            for name, error in failed.items()]  # fmt: skip
    for name, times in steps.items():
        if name in failed:
            continue
        median = statistics.median(times)
        rows.append({
            "runner": name, "device": str(device), "steps_timed": len(times),
            "median_step_s": median, "images_per_s": args.batch_size / median,
        })  # fmt: skip
    loop = None if PEER in failed else rows[0]["images_per_s"]
    for row in rows:
        if "failed" not in row:
            row["speed_vs_torch_loop"] = None if loop is None else row["images_per_s"] / loop
    return {"model": f"CifarCNN(width={args.width}, num_blocks={args.num_blocks})",
            "batch_size": args.batch_size, "device": str(device), "rounds": args.rounds,
            "rows": rows}  # fmt: skip


def report(result: dict) -> str:
    lines = [f"{result['model']}, batch {result['batch_size']}, {result['device']}, median "
             f"step of {result['rounds']} interleaved rounds"]  # fmt: skip
    for r in result["rows"]:
        if "failed" in r:
            lines.append(f"{r['runner']:>22} failed: {r['failed']}")
            continue
        speed = r["speed_vs_torch_loop"]
        lines.append(f"{r['runner']:>22} {r['images_per_s']:>9.0f} images/s "
                     f"{'-' if speed is None else f'{speed:.3f}x':>7} the loop")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_par.bench data")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=40, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup or args.rounds < 1:
        parser.error("--steps must exceed --warmup, and --rounds be >= 1")
    started = RunEnvironment.now()
    result = run(args)
    print_result(result, report, args.json, started)
    return 0
