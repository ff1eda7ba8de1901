"""A rank killed mid-run: what ``fault_tolerant=True`` costs against restarting from a checkpoint.

    python -m lightning_par.bench faults [--plugins ring_allreduce] [--worlds 3,4]
        [--steps 40] [--fault-step 15] [--width 32] [--num-blocks 4] [--batch-size 32]
        [--json]

For each plugin and world size, the CIFAR CNN (``--width``, ``--num-blocks``) trains on
cifar10-mini (``--batch-size`` images per rank, CPU, Lightning choosing the launch) as a
user's script in a process of its own, and the last rank is killed
(``LIGHTNING_PAR_FAULT=kill:rank=W-1:step=F``) as step ``F`` begins:

* **fault_tolerant**: the plugin's ``fault_tolerant=True``: the survivors go on;
* **restart** (the peer, what TorchElastic and a user do today): the plugin as it is, with
  a checkpoint every 10 steps (``--checkpoint-every``); the run ends with the lost rank
  named, and the script is run again from the newest checkpoint on as many ranks.

Reported per run: seconds from the fault to its detection (the survivors' first failed
message) and to the re-formed group, steps lost (done again), steps per second before and
after the fault, and the time lost: wall time from the last step before the fault to step
``F`` done again, less one step of the time before. ``restart / fault_tolerant`` is the
ratio of the times lost. A plugin without ``fault_tolerant`` is a row saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from lightning_par.bench._environment import RunEnvironment, print_result
from lightning_par.launch.faults import FAULT_ENV
from lightning_par.launch.processes import run_bounded

RUN = "lightning_par.bench._faults_run"
PLUGINS = ("ring_allreduce",)
#: The CNN's width and residual blocks, and the batch per rank (the defaults).
MODEL = (32, 4, 32)
LIMIT_S = 600.0


def _run(args: list[str], env: dict[str, str], folder: Path) -> str:
    """Run one script (as a user would, a process of its own); its output."""
    done = run_bounded([sys.executable, "-u", "-m", RUN, *args], LIMIT_S, env=env, cwd=folder)
    output = done.stdout + done.stderr
    if done.timed_out:
        raise RuntimeError(f"ran past {LIMIT_S:.0f} s: {output[-2000:]}")
    return output


def _read(path: Path) -> tuple[list[tuple[int, float]], dict[str, float]]:
    steps, events = [], {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if "step" in row:
            steps.append((row["step"], row["t"]))
        else:
            events.setdefault(row["event"], row["t"])
    return steps, events


def measure(
    plugin: str, world: int, approach: str, steps: int, fault: int, every: int,
    model: tuple[int, int, int] = MODEL,
) -> dict[str, Any]:  # fmt: skip
    """One plugin, one world size, one approach: the figures of the module docstring
    (``every``: steps between the restart approach's checkpoints; ``model``: the CNN's
    width and blocks, and the batch per rank)."""
    row: dict[str, Any] = {"plugin": plugin, "world": world, "approach": approach}
    with tempfile.TemporaryDirectory(prefix="lightning_par-bench-faults-") as tmp:
        folder, out = Path(tmp), Path(tmp) / "steps.jsonl"
        env = {**os.environ, FAULT_ENV: f"kill:rank={world - 1}:step={fault}"}
        sizes = ",".join(str(n) for n in model)
        args = [plugin, str(world), approach, str(steps), str(every), sizes, str(out)]
        output = _run(args, env, folder)
        if "RAISED" in output and approach == "fault_tolerant":
            return {**row, "failed": output.split("RAISED ", 1)[1].splitlines()[0]}
        if approach == "restart":
            env.pop(FAULT_ENV)
            more = _run([*args, "resume"], env, folder)
            output += more
        if not out.exists():
            return {**row, "failed": output[-500:]}
        done, events = _read(out)
    first = next(i for i, (s, _) in enumerate(done) if s == fault)  # the run before it
    last_before = done[first][1]  # step F-1 done (global_step == F): the fault comes next
    gaps = [(s, b - a) for (_, a), (s, b) in zip(done, done[1:])]
    step_s = statistics.median(g for s, g in gaps[:first] if s > 2)
    redone = next(t for s, t in done if s == fault + 1)
    after = [g for s, g in gaps if s > fault + 2]
    row.update(
        step_s=step_s,
        before_steps_per_s=1 / step_s,
        after_steps_per_s=1 / statistics.median(after) if after else None,
        steps_lost=sum(1 for s, _ in done if s <= fault) - fault,
        lost_s=redone - last_before - step_s,
    )
    if "lost" in events:
        row["detect_s"] = events["lost"] - last_before
        row["regroup_s"] = events["regrouped"] - events["lost"]
    return row


def _cell(value: Any, width: int, fmt: str) -> str:
    return f"{value:>{width}{fmt}}" if value is not None else f"{'-':>{width}}"


def report(result: dict[str, Any]) -> str:
    model = result["model"]
    lines = [
        f"a rank killed as step {result['fault_step']} begins (CIFAR CNN of width "
        f"{model['width']} with {model['num_blocks']} blocks, batch {model['batch_size']} per "
        "rank, CPU); times in seconds",
        f"{'plugin':<16}{'p':>3}  {'approach':<16}{'detect':>8}{'regroup':>9}{'steps lost':>11}"
        f"{'steps/s before':>16}{'after':>8}{'time lost':>11}",
    ]
    for row in result["rows"]:
        head = f"{row['plugin']:<16}{row['world']:>3}  {row['approach']:<16}"
        if "failed" in row:
            lines.append(f"{head}failed: {row['failed']}")
            continue

        cells = [("detect_s", 8, ".2f"), ("regroup_s", 9, ".2f"), ("steps_lost", 11, "d"),
                 ("before_steps_per_s", 16, ".2f"), ("after_steps_per_s", 8, ".2f"),
                 ("lost_s", 11, ".2f")]  # fmt: skip
        lines.append(head + "".join(_cell(row.get(k), w, f) for k, w, f in cells))
    for ratio in result["ratios"]:
        lines.append(
            f"{ratio['plugin']} p={ratio['world']}: restart loses "
            f"{ratio['restart_over_fault_tolerant']:.1f}x the time fault_tolerant does"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_par.bench faults")
    parser.add_argument("--plugins", default=",".join(PLUGINS))
    parser.add_argument("--worlds", default="3,4")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--fault-step", type=int, default=15)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--width", type=int, default=MODEL[0], help="the CNN's first channels")
    parser.add_argument("--num-blocks", type=int, default=MODEL[1], help="its residual blocks")
    parser.add_argument("--batch-size", type=int, default=MODEL[2], help="per rank and step")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not 3 < args.fault_step < args.steps - 3:
        parser.error("--fault-step must leave 3 steps before it and 3 after it")
    if not 0 < args.checkpoint_every < args.fault_step:
        parser.error("--checkpoint-every must be at least 1 and come before --fault-step")
    if min(args.width, args.num_blocks, args.batch_size) < 1:
        parser.error("--width, --num-blocks and --batch-size must be at least 1")
    model = (args.width, args.num_blocks, args.batch_size)
    started = RunEnvironment.now()
    rows, ratios = [], []
    for plugin in args.plugins.split(","):
        for world in (int(w) for w in args.worlds.split(",")):
            pair = {}
            for approach in ("fault_tolerant", "restart"):
                try:
                    pair[approach] = measure(plugin, world, approach, args.steps,
                                             args.fault_step, args.checkpoint_every,
                                             model)  # fmt: skip
                except Exception as err:  # a run that fails is a row saying so
                    pair[approach] = {"plugin": plugin, "world": world, "approach": approach,
                                      "failed": str(err).splitlines()[0]}  # fmt: skip
                rows.append(pair[approach])
            if all("lost_s" in r for r in pair.values()):
                ratio = pair["restart"]["lost_s"] / max(pair["fault_tolerant"]["lost_s"], 1e-3)
                ratios.append({"plugin": plugin, "world": world,
                               "restart_over_fault_tolerant": ratio})  # fmt: skip
    result = {
        "fault_step": args.fault_step, "steps": args.steps, "rows": rows, "ratios": ratios,
        "model": dict(zip(("width", "num_blocks", "batch_size"), model)),
    }  # fmt: skip
    print_result(result, report, args.json, started, indent=1)
    return 0
