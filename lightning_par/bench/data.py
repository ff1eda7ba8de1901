"""One Lightning training step with our data module against a plain torch loop doing the
same work, and where the difference goes.

    python -m lightning_par.bench data [--device cpu|cuda] [--models CifarCNN CifarRNN]
        [--steps 40] [--warmup 8] [--rounds 3] [--batch-size 256] [--precision 32-true]

Per model, three contenders (:mod:`._data_contenders`) train on the same device-resident
images, in interleaved rounds (each round another order): ``torch_loop``, a plain loop
making its batches with our data module's own augmentation (per-image crop and flip of the
padded image, normalisation: airbench's, on the device); ``lightning``, ``Trainer.fit``
(``strategy="auto"``) with ``CIFAR10DataModule(on_device=True)`` and the model as users get
it; ``lightning_loss_only``, the same with the training step's metric and ``self.log``
switched off. Each run is timed from the end of step ``--warmup`` to the end of the last,
the device synchronised only there (a synchronisation per step would stop the host from
queueing ahead, which is where a GPU hides a loop's overhead); a contender's figure is its
median round. Goal: ``lightning`` >= 0.9x the loop, on a GPU, for the CNN and the RNN.

Then one more run of the loop and of ``lightning``, profiled (:mod:`._step_profile`): the
self time of every action per step, in buckets (data, forward, backward, optimizer, our
metric and logging, callbacks, the module's, the strategy's and the loop's own hooks).
``make gpu-check`` runs this on CUDA. If the plain loop fails, its row says so
(``failed``) and Lightning's are still timed (:mod:`._peers`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import torch

from lightning_par.bench._data_contenders import (
    MODELS,
    device_sync,
    lightning_fit,
    make_model,
    torch_loop,
)
from lightning_par.bench._environment import RunEnvironment, print_result
from lightning_par.bench._peers import attempt
from lightning_par.bench._step_profile import BUCKETS, SelfTimeProfiler
from lightning_par.data import CIFAR10DataModule

#: The plain torch loop: the peer every ratio is to, and a failure is its row
PEER = "torch_loop"
CONTENDERS = (PEER, "lightning", "lightning_loss_only")
#: Lightning's speed the issue asks for, as a fraction of the loop's (on a GPU)
GOAL = 0.9
PROFILED = (PEER, "lightning")


def contend(name: str, run: dict[str, Any], model: str, data: CIFAR10DataModule,
            profiler: SelfTimeProfiler | None = None) -> float:  # fmt: skip
    """Seconds of contender ``name``'s timed window, on a fresh ``model``."""
    fresh = make_model(model, run["models"][model], loss_only=name == "lightning_loss_only")
    if name == PEER:
        return torch_loop(run, fresh, data, profiler)
    return lightning_fit(run, fresh, data, profiler)


def time_rounds(run: dict[str, Any], model: str, data: CIFAR10DataModule) -> list[dict]:
    """One row per contender: its median window over the interleaved rounds."""
    seconds: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    failed: dict[str, str] = {}
    for round_ in range(run["rounds"]):
        shift = round_ % len(CONTENDERS)
        for name in CONTENDERS[shift:] + CONTENDERS[:shift]:
            if name in failed:
                continue
            if name != PEER:
                seconds[name].append(contend(name, run, model, data))
                continue
            took, error = attempt(PEER, lambda: contend(PEER, run, model, data))
            if error is not None:
                failed[name] = error
            else:
                seconds[name].append(took)
    timed = run["steps"] - run["warmup"]
    rows: list[dict[str, Any]] = []
    for name in CONTENDERS:
        row: dict[str, Any] = {"model": model, "runner": name}
        if name in failed:
            rows.append({**row, "failed": failed[name]})
            continue
        step_s = statistics.median(seconds[name]) / timed
        rows.append({**row, "steps_timed": timed, "step_ms": 1e3 * step_s,
                     "round_step_ms": [1e3 * s / timed for s in seconds[name]],
                     "images_per_s": run["batch_size"] / step_s})  # fmt: skip
    loop = next((r["images_per_s"] for r in rows if r["runner"] == PEER and "failed" not in r),
                None)  # fmt: skip
    for row in rows:
        if "failed" not in row:
            row["speed_vs_torch_loop"] = None if loop is None else row["images_per_s"] / loop
    return rows


def profile_step(run: dict[str, Any], model: str, data: CIFAR10DataModule) -> dict[str, Any]:
    """Milliseconds per step in each bucket, for the loop and for Lightning (each bucket's
    median over ``profile_rounds`` interleaved runs), and Lightning's actions with the most
    self time (its last run's)."""
    timed = run["steps"] - run["warmup"]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in PROFILED}
    for _ in range(run["profile_rounds"]):
        for name in PROFILED:
            profiler = SelfTimeProfiler(device_sync(run["device"]))
            contend(name, run, model, data, profiler)
            runs[name].append(profiler.buckets_ms(timed))
    median = {n: {b: statistics.median(r[b] for r in runs[n]) for b in BUCKETS} for n in PROFILED}
    rows = [{"bucket": b, "what": what, **{f"{n}_ms": median[n][b] for n in PROFILED}}
            for b, what in BUCKETS.items()]  # fmt: skip
    return {"model": model, "buckets": rows,
            "profiled_step_ms": {n: sum(median[n].values()) for n in PROFILED},
            "lightning_top_actions": profiler.top_actions_ms(timed)}  # fmt: skip


def make_data(args: argparse.Namespace) -> CIFAR10DataModule:
    data = CIFAR10DataModule(source=args.source, batch_size=args.batch_size, on_device=True,
                             synthetic_size=args.train_images, val_size=0)  # fmt: skip
    data.setup("fit")
    return data


def run(args: argparse.Namespace) -> dict[str, Any]:
    options = {
        "CifarCNN": {"width": args.width, "num_blocks": args.num_blocks},
        "CifarRNN": {"hidden_size": args.hidden_size, "num_layers": args.num_layers},
    }
    device = torch.device(args.device)
    run_ = {"device": device, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
            "profile_rounds": args.profile_rounds, "precision": args.precision,
            "batch_size": args.batch_size,
            "models": {m: options[m] for m in args.models}}  # fmt: skip
    data = make_data(args)
    rows, profiles = [], []
    for model in args.models:
        rows += time_rounds(run_, model, data)
        if args.profile_rounds > 0:
            profiles.append(profile_step(run_, model, data))
    return {"models": {m: f"{m}({', '.join(f'{k}={v}' for k, v in o.items())})"
                       for m, o in run_["models"].items()},
            "data": data.source_used, "batch_size": args.batch_size, "device": str(device),
            "precision": args.precision, "steps": args.steps, "warmup": args.warmup,
            "rounds": args.rounds, "profile_rounds": args.profile_rounds,
            "goal_vs_torch_loop": GOAL, "rows": rows, "profiles": profiles}  # fmt: skip


def _speed_lines(result: dict[str, Any], model: str) -> list[str]:
    lines = [
        result["models"][model],
        f"  {'runner':<21} {'images/s':>9} {'step ms':>8} {'x loop':>7}",
    ]
    for r in (r for r in result["rows"] if r["model"] == model):
        if "failed" in r:
            lines.append(f"  {r['runner']:<21} failed: {r['failed']}")
            continue
        speed = r["speed_vs_torch_loop"]
        lines.append(f"  {r['runner']:<21} {r['images_per_s']:>9.0f} {r['step_ms']:>8.2f} "
                     f"{'-' if speed is None else f'{speed:.3f}':>7}")  # fmt: skip
    return lines


def _profile_lines(profile: dict[str, Any]) -> list[str]:
    lines = [
        f"  {'profile: ms per step (self time)':<45} {'loop':>8} {'lightning':>10} {'extra':>8}"
    ]
    for b in profile["buckets"]:
        loop, ours = b["torch_loop_ms"], b["lightning_ms"]
        lines.append(f"  {b['what']:<45} {loop:>8.3f} {ours:>10.3f} {ours - loop:>+8.3f}")
    total = profile["profiled_step_ms"]
    loop, ours = total["torch_loop"], total["lightning"]
    lines.append(f"  {'step (profiled)':<45} {loop:>8.3f} {ours:>10.3f} {ours - loop:>+8.3f}")
    return lines


def report(result: dict[str, Any]) -> str:
    lines = [f"batch {result['batch_size']}, {result['device']}, {result['precision']}, "
             f"{result['data']}; steps {result['warmup'] + 1}-{result['steps']} timed, median "
             f"of {result['rounds']} interleaved rounds; goal: lightning >= "
             f"{result['goal_vs_torch_loop']}x the loop on a GPU"]  # fmt: skip
    profiles = {p["model"]: p for p in result["profiles"]}
    for model in result["models"]:
        lines += _speed_lines(result, model)
        if model in profiles:
            lines += _profile_lines(profiles[model])
    return "\n".join(lines)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m lightning_par.bench data")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--steps", type=int, default=40, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=8, help="steps before the timed ones")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="32-true")
    parser.add_argument("--source", choices=["synthetic", "cifar10-mini"], default="synthetic")
    parser.add_argument("--train-images", type=int, default=50_000, help="synthetic images")
    parser.add_argument("--width", type=int, default=32, help="CifarCNN")
    parser.add_argument("--num-blocks", type=int, default=4, help="CifarCNN")
    parser.add_argument("--hidden-size", type=int, default=128, help="CifarRNN")
    parser.add_argument("--num-layers", type=int, default=2, help="CifarRNN")
    parser.add_argument(
        "--profile-rounds",
        type=int,
        default=1,
        help="profiled runs of the loop and of Lightning; 0: time only",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not 1 <= args.warmup < args.steps or args.rounds < 1 or args.profile_rounds < 0:
        parser.error("need 1 <= --warmup < --steps, --rounds >= 1, --profile-rounds >= 0")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print("bench data: no CUDA device: --device cuda needs an NVIDIA GPU and a CUDA build "
              f"of torch (torch {torch.__version__}); leave --device out to run on the CPU",
              file=sys.stderr)  # fmt: skip
        return 2
    started = RunEnvironment.now()
    result = run(args)
    print_result(result, report, args.json, started)
    return 0
