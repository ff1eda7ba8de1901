"""A process lost mid-run: what ``fault_tolerant=True`` costs against restarting from a checkpoint.

    python -m lightning_par.bench faults [--strategies ring_allreduce,local_sgd,parameter_server]
        [--worlds 3,4] [--steps 40] [--fault-step 15] [--width 32] [--num-blocks 4]
        [--batch-size 32] [--launch lightning|torchrun [--replace]] [--lost-rank last|first]
        [--json]

For each case of :data:`~lightning_par.bench._faults_cases.CASES` (a strategy and what it
loses: a rank, or a parameter server) and each world size, the CIFAR CNN (``--width``,
``--num-blocks``) trains on cifar10-mini (``--batch-size`` images per rank, CPU, Lightning
choosing the launch) in a user's script (:mod:`._faults_run`, run by :mod:`._faults_fits`),
and the last rank (rank 0 with ``--lost-rank first``), or the last server, is killed
(``LIGHTNING_PAR_FAULT=kill:rank=W-1:step=F``) as step ``F`` begins, Lightning choosing the
launch or, with ``--launch torchrun``, under ``torchrun --standalone`` (the fault-tolerant
runs alone there, each fit a script of its own):

* **fault_tolerant**: the strategy's ``fault_tolerant=True``: the survivors go on;
* **restart** (the peer, what TorchElastic and a user do today): the strategy as it is,
  with a checkpoint every 10 steps (``--checkpoint-every``); the run ends with the lost
  process named, and the script is run again from the newest checkpoint on as many ranks.

With ``--replace`` (under torchrun) torchrun is given ``--max-restarts=1``: the lost rank's
keeper starts a replacement, which joins the survivors at a step boundary
(:mod:`lightning_par.launch.joining`); its row also says when it joined (``joined_s``, from
the fault) and the pace after (``whole_steps_per_s``: every shard trained by its own rank
again).

Before them the strategy runs once as it is, without a fault: the reference weights.
Reported per run: seconds from the fault to its detection (the survivors' first failed
message) and to the re-formed group (ranks lost only: a lost server's shard moves without
one), steps lost (done again: by rank 0, or the lost replica's steps replayed by its
neighbour under ``local_sgd``), steps per second before and after the fault, the time lost
(wall time from the last step before the fault to the first step done after the survivors
recovered, or after the restart, less those steps at the pace before and the restart's wait
for its second script while other cases ran), the largest difference of rank 0's final
parameters from the reference's and, where the strategy claims the survivors end with the
reference's weights, whether they do. ``restart / fault_tolerant`` is the ratio of the
times lost (a floor where the survivors lost less than one step's time). A run that fails is
a row saying so.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from lightning_par.bench._environment import RunEnvironment, print_result
from lightning_par.bench._faults_cases import CASES, FaultCase, cases_for
from lightning_par.bench._faults_fits import (
    APPROACHES,
    MODEL,
    Fits,
    Plan,
    first_fits,
    fit_output,
    last_line,
    resume,
)
from lightning_par.bench._faults_report import report

#: ``local_sgd``'s line for a lost replica rebuilt by its neighbour: the steps it replayed
REPLAYED = re.compile(r"\((\d+) step\(s\) since replayed in")


def _read(path: Path) -> tuple[list[tuple[int, float]], dict[str, float]]:
    steps, events = [], {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if "step" in row:
            steps.append((row["step"], row["t"]))
        else:
            events.setdefault(row["event"], row["t"])
    return steps, events


def _weights(folder: Path, output: str) -> dict[str, torch.Tensor]:
    """Rank 0's parameters after the fit in ``folder``; a clear error if it saved none."""
    raised = re.search(r"^RAISED (.*)$", output, flags=re.M)
    if raised:
        raise RuntimeError(raised.group(1))
    path = folder / "weights.pt"
    if not path.exists():
        raise RuntimeError(f"no weights saved: {last_line(output)}")
    return torch.load(path, weights_only=True)


def measure(
    case: FaultCase, world: int, approach: str, plan: Plan, folder: Path, output: str,
    expected: dict[str, torch.Tensor] | None,
) -> dict[str, Any]:  # fmt: skip
    """One case, one world size, one approach: the figures of the module docstring, read
    from its fit's ``folder`` and ``output`` (``expected``: the reference weights, ``None``
    if that fit failed)."""
    weights = _weights(folder, output)
    done, events = _read(folder / "steps.jsonl")
    row: dict[str, Any] = {
        "strategy": case.strategy, "lost": case.lost, "world": world, "approach": approach,
        **_timings(done, plan.fault, events),
    }  # fmt: skip
    row["steps_lost"] += sum(int(n) for n in REPLAYED.findall(output))
    if "lost" in events:
        row["detect_s"] = events["lost"] - done[_first(done, plan.fault)][1]
        row["regroup_s"] = events["regrouped"] - events["lost"]
    if "joined" in events:  # (--replace)
        row["joined_s"] = events["joined"] - done[_first(done, plan.fault)][1]
        whole = [t for _, t in done if t > events["joined"]]
        gaps = [b - a for a, b in zip(whole, whole[1:])]
        row["whole_steps_per_s"] = 1 / statistics.median(gaps) if gaps else None
    if expected is not None:
        diff = max((weights[k] - v).abs().max().item() for k, v in expected.items())
        row["weights_max_diff"] = diff
        if approach == "fault_tolerant" and case.tolerance is not None:
            row["weights_equal"] = diff <= case.tolerance
    return row


def _first(done: list[tuple[int, float]], fault: int) -> int:
    """The index of the first ``step == fault`` line: step ``fault - 1`` done, the fault next."""
    return next(i for i, (s, _) in enumerate(done) if s == fault)


def _timings(done: list[tuple[int, float]], fault: int, events: dict[str, float]) -> dict[str, Any]:
    """Steps per second before and after the fault, steps done again (a step rank 0 finished
    twice) and the time lost: from step ``fault - 1`` done to the first step done (for the
    last time) after the last of the ``events`` (the survivors' regroup, under ``local_sgd``
    at the averaging that finds the loss; the restart's script started again), less those
    steps at the pace before and the restart's wait between its two scripts."""
    recovered = max((t for e, t in events.items() if e != "joined"), default=0.0)
    idle_s = events["launched"] - events["ended"] if "launched" in events else 0.0
    first = _first(done, fault)
    last_before = done[first][1]
    gaps = [(s, b - a) for (_, a), (s, b) in zip(done, done[1:])]
    step_s = statistics.median(g for s, g in gaps[:first] if s > 2)
    finished = dict(done)  # each step's last time: a restart does them again
    back = next(s for s in sorted(finished) if s > fault and finished[s] > recovered)
    until = events.get("joined", float("inf"))  # (--replace: the pace with fewer ranks)
    going = [t for s, t in done if s > back and finished[back] < t < until]  # the pace after
    after = [b - a for a, b in zip(going, going[1:])]
    return {
        "step_s": step_s,
        "before_steps_per_s": 1 / step_s,
        "after_steps_per_s": 1 / statistics.median(after) if after else None,
        "steps_lost": len(done) - len(finished),
        "lost_s": finished[back] - last_before - (back - fault) * step_s - idle_s,
    }


def _guarded(row: dict[str, Any], run: Any, *args: Any) -> Any:
    """``run(*args)``; a run that fails is ``row`` saying so (not the end of the benchmark)."""
    try:
        return run(*args)
    except Exception as err:
        return {**row, "failed": str(err).splitlines()[0] if str(err) else type(err).__name__}


def _rows(case: FaultCase, world: int, plan: Plan, fits: Fits, folder: Path) -> list[dict]:
    """One case at one world size: the reference's row if it failed, then one per approach."""
    head = {"strategy": case.strategy, "lost": case.lost, "world": world}
    rows = []
    expected = _guarded({**head, "approach": "reference"}, _weights,
                        folder / "reference", fit_output(fits, case, "reference"))  # fmt: skip
    if "failed" in expected:  # (a row, not weights)
        rows.append(expected)
        expected = None
    for approach in plan.approaches:
        output = fit_output(fits, case, "resume" if approach == "restart" else approach)
        rows.append(_guarded({**head, "approach": approach}, measure, case, world, approach,
                             plan, folder / approach, output, expected))  # fmt: skip
    return rows


def _resumed(case: FaultCase, world: int, plan: Plan, fits: Fits, folder: Path) -> str:
    """The restart's second run, if its first ended as it should: with the lost process."""
    first = fit_output(fits, case, "restart")
    if "RAISED" not in first:
        return "RAISED the fault did not end the restart's first run"
    if "RAISED the script" in first:  # (it ran past its time, or never ran)
        return first
    return resume(case, world, plan, folder)


def _ratio(ours: dict[str, Any], restart: dict[str, Any]) -> dict[str, Any]:
    """The restart's time lost over the survivors'; a loss shorter than one step cannot be
    told from the steps' own spread, so it counts as one step (the ratio is then a floor)."""
    at_least = ours["lost_s"] < ours["step_s"]
    ratio = restart["lost_s"] / max(ours["lost_s"], ours["step_s"])
    return {"restart_over_fault_tolerant": ratio, "at_least": at_least}


def bench(cases: list[FaultCase], worlds: list[int], plan: Plan) -> dict[str, Any]:
    """Every case at every world size: its rows and the ratios of the times lost."""
    rows, ratios = [], []
    for world in worlds:
        with tempfile.TemporaryDirectory(prefix="lightning_par-bench-faults-") as tmp:
            fits = first_fits(cases, world, plan, Path(tmp))
            for case in cases:
                if "restart" in plan.approaches:
                    fits[case.name, "resume"] = _resumed(case, world, plan, fits, Path(tmp))
                done = _rows(case, world, plan, fits, Path(tmp) / case.folder)
                rows += done
                pair = {row["approach"]: row for row in done}
                if all("lost_s" in pair.get(a, {}) for a in APPROACHES):
                    ratios.append({"strategy": case.strategy, "lost": case.lost, "world": world,
                                   **_ratio(pair["fault_tolerant"], pair["restart"])})  # fmt: skip
    return {"rows": rows, "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_par.bench faults")
    covered = ",".join(dict.fromkeys(case.strategy for case in CASES))
    parser.add_argument("--strategies", default=covered, help=f"of {covered}")
    parser.add_argument("--worlds", default="3,4")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--fault-step", type=int, default=15)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--width", type=int, default=MODEL[0], help="the CNN's first channels")
    parser.add_argument("--num-blocks", type=int, default=MODEL[1], help="its residual blocks")
    parser.add_argument("--batch-size", type=int, default=MODEL[2], help="per rank and step")
    parser.add_argument(
        "--launch",
        choices=("lightning", "torchrun"),
        default="lightning",
        help="Lightning chooses the launch, or torchrun --standalone",
    )
    parser.add_argument(
        "--lost-rank",
        choices=("last", "first"),
        default="last",
        help="the rank a case that loses a rank kills: the last, or rank 0",
    )
    parser.add_argument(
        "--replace",
        action="store_true",
        help="under torchrun: --max-restarts=1, a replacement joins the survivors",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.replace and args.launch != "torchrun":
        parser.error("--replace needs --launch torchrun (its --max-restarts starts it)")
    if not 3 < args.fault_step < args.steps - 3:
        parser.error("--fault-step must leave 3 steps before it and 3 after it")
    restarts = args.launch == "lightning"  # (under torchrun the survivors alone are measured)
    if restarts and not 0 < args.checkpoint_every < args.fault_step:
        parser.error("--checkpoint-every must be at least 1 and come before --fault-step")
    if min(args.width, args.num_blocks, args.batch_size) < 1:
        parser.error("--width, --num-blocks and --batch-size must be at least 1")
    try:
        cases = cases_for(args.strategies.split(","))
    except ValueError as err:
        parser.error(str(err))
    model = (args.width, args.num_blocks, args.batch_size)
    plan = Plan(args.steps, args.fault_step, args.checkpoint_every, model, args.launch,
                args.lost_rank, args.replace)  # fmt: skip
    started = RunEnvironment.now()
    result = {
        "fault_step": args.fault_step, "steps": args.steps, "launch": args.launch,
        "lost_rank": args.lost_rank, "replace": args.replace,
        **bench(cases, [int(w) for w in args.worlds.split(",")], plan),
        "model": dict(zip(("width", "num_blocks", "batch_size"), model)),
    }  # fmt: skip
    print_result(result, report, args.json, started, indent=1)
    return 0
