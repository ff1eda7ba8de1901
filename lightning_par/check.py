"""``python -m lightning_par.check``: every example under every strategy, a few steps each.

Runs on the best available accelerator (and on CPU), one row per (strategy, model,
accelerator). The rows of one accelerator run one after the other in one subprocess, so
its start-up (imports, CUDA) is paid once; their ranks start through a forkserver, clean of
whatever earlier rows initialised; each row has a timeout after which its ranks are stopped,
and a row the subprocess could not report (it crashed or hung) runs again in a subprocess
of its own. This process never initialises CUDA. Prints a Markdown table: strategy, model,
device, processes, ok/failed, images/s, seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from lightning_par.launch.processes import run_bounded, time_limit
from lightning_par.quiet import quiet_report
from lightning_par.strategies import plugin_names
from lightning_par.strategies.registry import parse_choice, spec

RESULT_TAG = "CHECK_RESULT "
#: Processes a strategy needs with its default options (hybrid: dp x mp ranks, mp = 2). On a
#: machine with fewer devices (one GPU) its row is "not run", with the reason, not failed.
MIN_PROCESSES = {"hybrid": 2}
MODELS = ("CifarCNN", "CifarRNN")


def registered_strategies() -> list[str]:
    """Lightning's DDP (the reference, under our launch policy), then every plugin."""
    return ["lightning_ddp", *plugin_names()]


def run_row(strategy: str, model: str, accelerator: str, devices: int, steps: int) -> dict:
    """Train ``model`` for ``steps`` steps on synthetic data (runs in the row's subprocess)
    under ``strategy``: ``"single"``, a registered name, or one with options of its own
    (``zero:stage=1``, :func:`~lightning_par.strategies.registry.parse_choice`)."""
    import logging

    import lightning.pytorch as pl

    import lightning_par  # noqa: F401
    from lightning_par.data import CIFAR10DataModule
    from lightning_par.models import CifarCNN, CifarRNN
    from lightning_par.summary import ThroughputMonitor, strategy_label

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    pl.seed_everything(0, verbose=False)
    net = CifarCNN(width=16, num_blocks=2) if model == "CifarCNN" else CifarRNN(hidden_size=64)
    data = CIFAR10DataModule(source="synthetic", batch_size=32, synthetic_size=32 * (steps + 2))
    monitor = ThroughputMonitor()
    name, options = parse_choice(strategy)
    chosen = spec(name).create(**options) if options else name
    trainer = pl.Trainer(
        strategy="auto" if strategy == "single" else chosen,
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
    ran = strategy_label(trainer.strategy)  # the registered name, as the summary line says
    expected = "single_device" if strategy == "single" else name
    if ran != expected:
        raise RuntimeError(f"asked for strategy {expected!r}, the Trainer ran {ran!r}")
    return {"images_per_s": ips, "loss": float(trainer.callback_metrics.get("train_loss", -1)),
            "ran": ran}  # fmt: skip


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


def run_rows(rows: list[list], steps: int, timeout: float) -> int:
    """Run rows one after the other in this process (one accelerator's rows share its start-up:
    imports, CUDA). Ranks start through a forkserver, clean whatever earlier rows left
    here (CUDA, autograd threads, OpenMP); each row has ``timeout`` seconds, after which its
    ranks are stopped and the next row runs."""
    os.environ.setdefault("LIGHTNING_PAR_START_METHOD", "forkserver")
    for index, (strategy, model, accel, devices) in enumerate(rows):
        start = time.perf_counter()
        try:
            message = f"timed out after {timeout:.0f} s; every process of the row was killed"
            with time_limit(timeout, message):
                result = run_row(strategy, model, accel, int(devices), steps)
        except Exception as err:  # this row failed; the others still run
            result = {"error": f"{type(err).__name__}: {err}".splitlines()[0][:200]}
        result.update(index=index, seconds=round(time.perf_counter() - start, 1))
        print(RESULT_TAG + json.dumps(result), flush=True)
    return 0


def check_group(rows: list[tuple], steps: int, timeout: float) -> list[dict]:
    """Every row of one accelerator in one subprocess; rows it could not report (it crashed
    or ran out of time) run again, each in a subprocess of its own. A row with fewer devices
    than its strategy needs (:data:`MIN_PROCESSES`) is "not run", with the reason."""
    runnable = [r for r in rows if int(r[3]) >= MIN_PROCESSES.get(r[0], 1)]
    reported = {}
    if runnable:
        cmd = [sys.executable, "-m", "lightning_par.check", "--steps", str(steps),
               "--timeout", str(timeout), "--run-rows", json.dumps(runnable)]  # fmt: skip
        proc = run_bounded(cmd, timeout * len(runnable) + 120)
        for line in proc.stdout.splitlines():
            if line.startswith(RESULT_TAG):
                found = json.loads(line[len(RESULT_TAG) :])
                reported[tuple(runnable[found.pop("index")])] = found
    out = []
    for strategy, model, accel, devices in rows:
        row = {"strategy": strategy, "model": model, "device": accel, "processes": devices}
        need = MIN_PROCESSES.get(strategy, 1)
        if int(devices) < need:
            reason = (f"{strategy} needs {need} processes with its default options and "
                      f"{devices} {accel} device(s) are here")  # fmt: skip
            out.append({**row, "status": "not run", "error": reason})
            continue
        found = reported.get((strategy, model, accel, devices)) or _own_subprocess(
            row, steps, timeout
        )
        status = "failed" if "error" in found else "ok"
        out.append({**row, "status": status, **found})
    return out


def _own_subprocess(row: dict, steps: int, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "lightning_par.check", "--steps", str(steps), "--run-row",
           row["strategy"], row["model"], row["device"], str(row["processes"])]  # fmt: skip
    start = time.perf_counter()
    proc = run_bounded(cmd, timeout)
    found = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    seconds = round(time.perf_counter() - start, 1)
    if proc.returncode == 0 and found:
        return {**json.loads(found[-1][len(RESULT_TAG) :]), "seconds": seconds}
    if proc.timed_out:
        error = f"timed out after {timeout:.0f} s; every process of the row was killed"
    else:
        error = ((proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"])[0]
    return {"error": error[:200], "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", nargs="*", help="default: every registered strategy")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    parser.add_argument("--accelerators", nargs="*", default=["cuda", "cpu"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per row")
    parser.add_argument("--json", action="store_true", help="print rows as JSON")
    parser.add_argument("--run-row", nargs=4, metavar=("STRATEGY", "MODEL", "ACCEL", "DEVICES"))
    parser.add_argument("--run-rows", metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    quiet_report()  # here and in each row's subprocess, which runs main() too
    if args.run_row:
        strategy, model, accel, devices = args.run_row
        result = run_row(strategy, model, accel, int(devices), args.steps)
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(RESULT_TAG + json.dumps(result), flush=True)
        return 0
    if args.run_rows:
        return run_rows(json.loads(args.run_rows), args.steps, args.timeout)

    strategies = args.strategies or registered_strategies()
    results = []
    if not args.json:
        print(_header(), flush=True)
    rows = plan(strategies, args.models, args.accelerators)
    for accel in dict.fromkeys(r[2] for r in rows):
        group = [r for r in rows if r[2] == accel]
        for row in check_group(group, args.steps, args.timeout):
            results.append(row)
            if not args.json:
                print(_format_row(row), flush=True)
    if args.json:
        print(json.dumps(results, indent=1))
    failed = [r for r in results if r["status"] == "failed"]
    for r in results:
        if r["status"] != "ok":
            print(f"{r['status'].upper()} {r['strategy']} {r['model']} {r['device']}: "
                  f"{r.get('error')}")  # fmt: skip
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
        f"| {ips} | {r.get('seconds', '-')} |"
    )


if __name__ == "__main__":
    sys.exit(main())
