"""``python -m lightning_par.check``: every example under every strategy, a few steps each.

Runs on the best available accelerator (and on CPU), one row per (strategy, model,
accelerator), each in its own subprocess with a timeout so one broken or hung row cannot
stop the others or initialise CUDA in a parent that later forks. Prints a Markdown table:
strategy, model, device, processes, ok/failed, images/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from lightning_par.comm.run import run_bounded

RESULT_TAG = "CHECK_RESULT "
MODELS = ("CifarCNN", "CifarRNN")


def registered_strategies() -> list[str]:
    """Lightning's DDP (the reference, under our launch policy), then every plugin."""
    from lightning_par.strategies import plugin_names

    return ["lightning_ddp", *plugin_names()]


def run_row(strategy: str, model: str, accelerator: str, devices: int, steps: int) -> dict:
    """Train ``model`` for ``steps`` steps on synthetic data (runs in the row's subprocess)."""
    import logging

    import lightning.pytorch as pl

    import lightning_par  # noqa: F401
    from lightning_par.data import CIFAR10DataModule
    from lightning_par.models import CifarCNN, CifarRNN
    from lightning_par.summary import ThroughputMonitor

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    pl.seed_everything(0, verbose=False)
    net = CifarCNN(width=16, num_blocks=2) if model == "CifarCNN" else CifarRNN(hidden_size=64)
    data = CIFAR10DataModule(source="synthetic", batch_size=32, synthetic_size=32 * (steps + 2))
    monitor = ThroughputMonitor()
    trainer = pl.Trainer(
        strategy="auto" if strategy == "single" else strategy,
        accelerator=accelerator,
        devices=devices,
        max_steps=steps,
        limit_val_batches=0,
        callbacks=[monitor],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(net, datamodule=data)
    ips = float(trainer.callback_metrics.get("train_images_per_s", float("nan")))
    return {"images_per_s": ips, "loss": float(trainer.callback_metrics.get("train_loss", -1))}


def plan(strategies: list[str], models: list[str], accelerators: list[str]) -> list[tuple]:
    import torch

    gpus = torch.cuda.device_count()  # NVML-based: does not initialise CUDA
    rows = []
    for accel in accelerators:
        if accel == "cuda" and gpus == 0:
            continue
        width = 2 if accel == "cpu" else min(2, gpus)
        for model in models:
            rows.append(("single", model, accel, 1))
            rows += [(s, model, accel, width) for s in strategies]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", nargs="*", help="default: every registered strategy")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    parser.add_argument("--accelerators", nargs="*", default=["cuda", "cpu"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per row")
    parser.add_argument("--json", action="store_true", help="print rows as JSON")
    parser.add_argument("--run-row", nargs=4, metavar=("STRATEGY", "MODEL", "ACCEL", "DEVICES"))
    args = parser.parse_args(argv)
    from lightning_par.quiet import quiet_lightning

    quiet_lightning()  # here and in each row's subprocess, which runs main() too
    if args.run_row:
        strategy, model, accel, devices = args.run_row
        result = run_row(strategy, model, accel, int(devices), args.steps)
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(RESULT_TAG + json.dumps(result), flush=True)
        return 0

    strategies = args.strategies or registered_strategies()
    results = []
    if not args.json:
        print(_header(), flush=True)
    for strategy, model, accel, devices in plan(strategies, args.models, args.accelerators):
        cmd = [sys.executable, "-m", "lightning_par.check", "--steps", str(args.steps)]
        cmd += ["--run-row", strategy, model, accel, str(devices)]
        start = time.perf_counter()
        row = {"strategy": strategy, "model": model, "device": accel, "processes": devices}
        proc = run_bounded(cmd, args.timeout)
        found = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
        if proc.returncode == 0 and found:
            row.update(status="ok", **json.loads(found[-1][len(RESULT_TAG) :]))
        elif proc.timed_out:
            row.update(status="failed", error=f"timed out after {args.timeout:.0f} s; "
                       "every process of the row was killed")  # fmt: skip
        else:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            row.update(status="failed", error=tail[0][:200])
        row["seconds"] = round(time.perf_counter() - start, 1)
        results.append(row)
        if not args.json:
            print(_format_row(row), flush=True)
    if args.json:
        print(json.dumps(results, indent=1))
    failed = [r for r in results if r["status"] != "ok"]
    for r in failed:
        print(f"FAILED {r['strategy']} {r['model']} {r['device']}: {r.get('error')}")
    return 1 if failed else 0


def _header() -> str:
    return (
        "| strategy | model | device | processes | status | images/s | seconds |\n"
        "|---|---|---|---|---|---|---|"
    )


def _format_row(r: dict) -> str:
    ips = r.get("images_per_s", float("nan"))
    ips = "-" if ips != ips else f"{ips:.0f}"  # NaN: too few steps to time
    return (
        f"| {r['strategy']} | {r['model']} | {r['device']} | {r['processes']} | {r['status']} "
        f"| {ips} | {r['seconds']} |"
    )


if __name__ == "__main__":
    sys.exit(main())
