"""ZeRO's memory, messages and speed, stage by stage, beside ``ring_allreduce`` and torch's
``fully_shard`` (same model, batch and ranks, one run).

    python -m lightning_par.bench zero --world-sizes 2 4
    python -m lightning_par.bench zero --world-sizes 2 --models mlp --steps 3 --warmup 1 --json

Each rank (CPU, gloo, started by ``run_on_ranks``) trains a CifarCNN and a wide MLP with
Adam under every contender (:mod:`._zero_run`) and reports:

* **bytes held** by rank after backward, counted from the live tensors (the distinct
  storages, at their current size, of the parameters: the units' padded buffers or
  shards, which the parameters and the optimizer's pieces are views of; of their
  gradients; of the optimizer's state; of the gradient buckets ``ring_allreduce`` and
  stage 1 keep), against the paper's formula (fp32 Adam: ``4Ψ + 4Ψ + 8Ψ``, the terms a
  stage shards divided by ``p``; ``fully_shard`` against stage 3's) and against the exact
  count of :func:`lightning_par.zero.cost.held` (padding, Adam's ``step``, buckets): the
  largest rank's;
* **peak** bytes of live tensor storage during one step, counted as
  :mod:`._live_bytes` says (every storage alive, followed operator by operator on the
  step's thread; the data set left out): the largest rank's;
* **bytes and messages sent** per step by each rank, from the trace, against
  :func:`lightning_par.zero.cost.sent` (stage 3's first step, which gathers every unit
  once, apart);
* **step time**: the median over the timed steps of the slowest rank's, its ratio to
  ``ring_allreduce``'s and ``fully_shard``'s speed over ours.

Goals (issue 39): model states within 10 % of the formula; stages 1-2 at most 1.1x
``ring_allreduce``'s step; stage 3 at least ``fully_shard``'s speed. ``fully_shard`` is the
peer: if it fails (a torch without FSDP2, an error in its fit, a rank lost in it), its row
says so (``failed``) and ours are still measured (:mod:`._peers`); a failure of ours ends
the run with its traceback.
"""

from __future__ import annotations

import argparse
import statistics

from lightning_par.bench._environment import RunEnvironment, print_result
from lightning_par.bench._peers import run_with_peers
from lightning_par.bench._zero_run import measure
from lightning_par.zero.cost import formula, held, sent

CONTENDERS = ["ring_allreduce", "zero1", "zero2", "zero3", "fully_shard"]
STAGE = {"ring_allreduce": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fully_shard": 3}
MEMORY_TOLERANCE = 0.10


def _memory(row: dict, ranks: list[dict], p: int, stage: int, psi: int) -> None:
    states = [r["held"].model_states for r in ranks]
    top = max(range(p), key=states.__getitem__)
    mine = ranks[top]["held"]
    want = formula(psi, stage, p)
    row.update(params_bytes=mine.params, grads_bytes=mine.grads, optimizer_bytes=mine.optimizer,
               buffers_bytes=mine.buffers, model_states_bytes=mine.model_states,
               formula_bytes=want.model_states)  # fmt: skip
    row["peak_bytes"] = max(r["peak"] for r in ranks)
    row["held_vs_formula"] = mine.model_states / want.model_states
    row["with_buffers_vs_formula"] = (mine.model_states + mine.buffers) / want.model_states
    row["memory_goal_met"] = abs(row["held_vs_formula"] - 1) <= MEMORY_TOLERANCE
    if ranks[0]["plan"] is not None:
        exact = [held(ranks[r]["plan"], p, r) for r in range(p)]
        row["exact_bytes"] = exact[top].model_states
        row["held_is_exact"] = all(ranks[r]["held"] == exact[r] for r in range(p))


def _messages(row: dict, ranks: list[dict], p: int) -> None:
    plan = ranks[0]["plan"]
    if plan is None:
        return
    steady = [sent(plan, p, r) for r in range(p)]
    first = [sent(plan, p, r, first_step=True) for r in range(p)]
    (first_bytes, _), (step_bytes, step_messages) = ranks[0]["sent"][0], ranks[0]["sent"][-1]
    row.update(bytes_sent_per_step=step_bytes, bytes_sent_model=steady[0].bytes,
               messages_per_step=step_messages, messages_model=steady[0].messages,
               first_step_bytes=first_bytes, first_step_bytes_model=first[0].bytes)  # fmt: skip
    row["sent_matches_model"] = all(
        ranks[r]["sent"][0] == (first[r].bytes, first[r].messages)
        and all(s == (steady[r].bytes, steady[r].messages) for s in ranks[r]["sent"][1:])
        for r in range(p)
    )


def rows_for(kind: str, p: int, results: list[dict], contenders: list[str],
             failed: dict[str, str]) -> list[dict]:  # fmt: skip
    """The rows of one model at ``p`` ranks; a contender in ``failed`` (``"<model>/<name>"``
    -> its failure) is a row saying so."""
    rows = []
    for name in contenders:
        row = {"model": kind, "world_size": p, "contender": name, "stage": STAGE[name]}
        if f"{kind}/{name}" in failed:
            rows.append({**row, "failed": failed[f"{kind}/{name}"]})
            continue
        ranks = [res[f"{kind}/{name}"] for res in results]
        slowest = [max(step) for step in zip(*(r["times"] for r in ranks))]
        row.update(params=ranks[0]["psi"], steps_timed=len(slowest),
                   median_step_s=statistics.median(slowest))  # fmt: skip
        _memory(row, ranks, p, STAGE[name], ranks[0]["psi"])
        _messages(row, ranks, p)
        rows.append(row)
    _ratios(rows)
    return rows


def _ratios(rows: list[dict]) -> None:
    """Each row's step, peak and bytes against ``ring_allreduce``'s and ``fully_shard``'s,
    and the goal of its stage."""
    by = {r["contender"]: r for r in rows if "failed" not in r}
    ring, fsdp = by.get("ring_allreduce"), by.get("fully_shard")
    for row in by.values():
        if ring is not None:
            row["step_vs_ring"] = row["median_step_s"] / ring["median_step_s"]
            row["peak_vs_ring"] = row["peak_bytes"] / ring["peak_bytes"]
            if "bytes_sent_per_step" in row:
                row["sent_vs_ring"] = row["bytes_sent_per_step"] / ring["bytes_sent_per_step"]
        if fsdp is not None:
            row["speed_vs_fully_shard"] = fsdp["median_step_s"] / row["median_step_s"]
        if row["contender"] in ("zero1", "zero2") and ring is not None:
            row["step_goal"], row["step_goal_met"] = (
                "<= 1.1x ring_allreduce",
                row["step_vs_ring"] <= 1.1,
            )
        if row["contender"] == "zero3" and fsdp is not None:
            row["step_goal"] = ">= 1.0x fully_shard's speed"
            row["step_goal_met"] = row["speed_vs_fully_shard"] >= 1.0


def run(args, p: int) -> list[dict]:
    options = {k: getattr(args, k) for k in ("mlp_width", "mlp_depth", "cnn_width", "cnn_blocks",
               "batch_size", "steps", "warmup", "bucket_cap_mb")}  # fmt: skip
    results, failed = run_with_peers(measure, p, args.models, args.contenders, options,
                                     args.rounds, timeout=args.timeout)  # fmt: skip
    return [row for kind in args.models
            for row in rows_for(kind, p, results, args.contenders, failed)]  # fmt: skip


def report(result: dict) -> str:
    mb = 2**20
    lines = [f"{'model':>5} {'p':>2} {'contender':>14} {'params':>7} {'grads':>7} {'state':>7} "
             f"{'buckets':>7} {'vs formula':>10} {'peak':>7} {'sent KiB':>9} {'model':>9} "
             f"{'step ms':>8} {'vs ring':>7} {'fsdp/us':>7}"]  # fmt: skip
    for r in result["rows"]:
        head = f"{r['model']:>5} {r['world_size']:>2} {r['contender']:>14}"
        if "failed" in r:
            lines.append(f"{head} failed: {r['failed']}")
            continue
        sent_kib = (
            f"{r['bytes_sent_per_step'] / 1024:>9.1f}" if "bytes_sent_per_step" in r else " " * 9
        )
        model_kib = f"{r['bytes_sent_model'] / 1024:>9.1f}" if "bytes_sent_model" in r else " " * 9
        lines.append(
            f"{head} {r['params_bytes'] / mb:>7.2f} {r['grads_bytes'] / mb:>7.2f} "
            f"{r['optimizer_bytes'] / mb:>7.2f} {r['buffers_bytes'] / mb:>7.2f} "
            f"{r['held_vs_formula']:>10.3f} {r['peak_bytes'] / mb:>7.2f} {sent_kib} {model_kib} "
            f"{r['median_step_s'] * 1e3:>8.1f} {r.get('step_vs_ring', float('nan')):>7.2f} "
            f"{r.get('speed_vs_fully_shard', float('nan')):>7.2f}"
        )
    lines.append(
        "MiB held by the fullest rank after backward; peak: live tensor storage in a step; "
        "sent: rank 0's bytes per step, measured and modelled; fsdp/us: fully_shard's step "
        "time over ours (> 1: ours faster); gloo"
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_par.bench zero")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--models", nargs="+", default=["cnn", "mlp"], choices=["cnn", "mlp"])
    parser.add_argument("--contenders", nargs="+", default=CONTENDERS, choices=CONTENDERS)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per fit")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the timed ones")
    parser.add_argument("--rounds", type=int, default=2, help="fits per contender, interleaved")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--mlp-width", type=int, default=768)
    parser.add_argument("--mlp-depth", type=int, default=4)
    parser.add_argument("--cnn-width", type=int, default=16)
    parser.add_argument("--cnn-blocks", type=int, default=2)
    parser.add_argument("--bucket-cap-mb", type=float, default=4.0)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per world size")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    args = parser.parse_args(argv)
    if min(args.world_sizes) < 2 or args.steps < 1 or args.warmup < 1 or args.rounds < 1:
        parser.error("--world-sizes must be >= 2, --steps, --warmup and --rounds >= 1")
    started = RunEnvironment.now()
    rows = [row for p in args.world_sizes for row in run(args, p)]
    print_result({"backend": "gloo", "rows": rows}, report, args.json, started)
    return 0
