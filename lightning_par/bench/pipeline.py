"""Pipeline benchmark: naive split vs our four schedules vs torch.distributed.pipelining.

``python -m lightning_par.bench pipeline [--workload linear,cnn] [--chunks 2,4,8]
[--stages 2] [--virtual-stages 2] [--json]``

``K = --stages`` devices (processes, gloo, one thread each so that two stages share the
two cores of the reference machine fairly), the same model for every contender, cut into
``K`` stages (``K*v`` for the interleaved ones, the same cut for ours and torch's), in one
run:

* one process on the whole model (1 thread and 2 threads) for context;
* the naive split (``M = 1``: one stage works while the other waits);
* our GPipe and 1F1B for several ``M`` (``checkpoint="never"``: no recomputation, like
  torch's schedule), with the measured bubble from the trace next to (K-1)/(M+K-1);
* our interleaved 1F1B (``v`` stages per device), zero bubble (ZB-H1 order, B/W split)
  and ZBV (two stages per device in a V, B/W split) on
  :class:`~lightning_par.pipeline.multistage.DeviceStages` (:mod:`.pipeline_v`), each
  row's ``theory_bubble`` its own formula (:meth:`~lightning_par.pipeline.schedules.
  Schedule.bubble`) beside the bubble measured from the traces and the schedule replayed
  with the step costs the traces measured (``theory_bubble_measured_costs``,
  :func:`~lightning_par.pipeline.timeline.replayed_bubble`: the formula's idle time without
  its equal-cost assumption; ``mean_step_ms``: the mean F, B, W spans) and the gap between
  measured and formula split in two, ``bubble_gap_costs`` (replay - formula: unequal
  stages and step costs) and ``bubble_gap_runtime`` (measured - replay: time lost between
  steps), and ``imbalance_floor``, the bubble unequal devices leave under any schedule
  (``1 - mean/max`` of the devices' CPU per step);
* each layout's cut per ``M`` (``balances``; ``balance`` per row), the one whose schedules
  replayed with per-layer costs measured at that micro-batch size step fastest
  (:func:`~lightning_par.pipeline.partition.balance_by_replay`; torch's rows run on the
  same cut as ours of the same layout);
* torch's ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
  ``ScheduleInterleavedZeroBubble`` and ``ScheduleZBVZeroBubble`` on the same stages, each
  the peer of our schedule of the same kind at the same ``M`` (``speedup_vs_torch_peer``);
* per stage of ours, the peak bytes of activations saved for backward during one step
  (``peak_saved_bytes``, counted with ``saved_tensors_hooks``);
* each stage's CPU time per step (nearly blind to load from other processes) and, for our
  rows, the messages and bytes each stage sent per step;
* activation bytes each stage stores between forward and backward per re-materialisation
  mode at the largest ``M`` (counted with ``saved_tensors_hooks``).

``--keep-freed-memory``: every process keeps freed memory mapped (:mod:`.malloc`), which
removes the page faults of re-allocating each step's activations (10-15 % of the stages' CPU
on the CNN) for every contender alike.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
import torch.distributed as dist
from torch import nn

from lightning_par.bench.malloc import keep_freed_memory
from lightning_par.bench.pipeline_v import (
    OURS_V,
    PEERS_V,
    TORCH_V_SCHEDULES,
    layout_of,
    ours_v,
    runs,
    schedule_of,
    theirs_v,
    virtual_of,
)
from lightning_par.comm import CommTrace, Communicator, run_on_ranks
from lightning_par.models import CifarCNN
from lightning_par.pipeline import (
    CHECKPOINT_MODES,
    PipelineStage,
    balance_by_params,
    forward_backward,
    split_sequential,
)
from lightning_par.pipeline.partition import balance_by_replay, layer_times
from lightning_par.pipeline.schedules import (
    GPIPE,
    INTERLEAVED,
    ONE_F_ONE_B,
    ZBV,
    ZERO_BUBBLE,
    Schedule,
)
from lightning_par.pipeline.timeline import mean_costs, measured_bubble, replayed_bubble


def linear_workload() -> tuple[nn.Sequential, torch.Tensor, torch.Tensor, nn.Module]:
    """8 x (Linear(1024) + ReLU), batch 256: compute-dominated, easy to balance."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    x, y = torch.randn(256, 1024), torch.randn(256, 1024)
    return nn.Sequential(*layers), x, y, nn.MSELoss()


def cnn_workload(batch: int = 64) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor, nn.Module]:
    """The course's CIFAR CNN (width 32, 4 residual blocks), batch 64."""
    torch.manual_seed(0)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    return CifarCNN().net, x, y, nn.CrossEntropyLoss()


WORKLOADS = {"linear": linear_workload, "cnn": cnn_workload}
#: our schedules on one PipelineStage per device, and torch.distributed.pipelining's peers
OURS = (GPIPE, ONE_F_ONE_B)
TORCH_SCHEDULES = tuple(s.torch_peer for s in OURS)
PEERS = {s.name: f"torch {s.torch_peer}" for s in OURS}


def _time_steps(step, optimizer, warmup: int, steps: int, rounds: int = 1) -> tuple[float, float]:
    """Seconds per training step, wall clock and this thread's CPU time: the best of ``rounds``
    rounds of ``steps`` steps (the best, because on a shared machine other processes only
    ever add time). CPU time barely moves with load from elsewhere, so it shows what a change
    costs or saves when the wall clock cannot (it leaves out gloo's own threads)."""

    def one_step():
        optimizer.zero_grad()
        step()
        optimizer.step()

    for _ in range(warmup):
        one_step()
    best, best_cpu = float("inf"), float("inf")
    for _ in range(rounds):
        if dist.is_initialized():
            dist.barrier()
        start, cpu = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            one_step()
        cpu = time.thread_time() - cpu
        if dist.is_initialized():
            dist.barrier()
        best = min(best, (time.perf_counter() - start) / steps)
        best_cpu = min(best_cpu, cpu / steps)
    return best, best_cpu


def _single(rank: int, world_size: int, workload: str, threads: int, warmup: int, steps: int,
            rounds: int, keep_memory: bool = False):  # fmt: skip
    if keep_memory:
        keep_freed_memory()
    torch.set_num_threads(threads)
    net, x, y, loss_fn = WORKLOADS[workload]()
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    return _time_steps(lambda: loss_fn(net(x), y).backward(), opt, warmup, steps, rounds)[0]


def _stage_input(net: nn.Sequential, balance: list[int], stage: int, x: torch.Tensor):
    with torch.no_grad():
        return net[: sum(balance[:stage])](x) if stage else x


def _balances(workload: str, base: nn.Sequential, x: torch.Tensor, k: int, v: int,
              chunks: list[int], rank: int) -> dict[str, dict[int, list[int]]]:  # fmt: skip
    """The cut of each layout (``"pipeline"``: one stage per device, ``"interleaved"``: ``v``
    dealt round-robin, ``"zbv"``: two in a V) at each micro-batch count ``M`` (1 for the
    naive split): the one whose schedules, replayed with per-layer costs measured at that
    micro-batch size, step fastest (:func:`~lightning_par.pipeline.partition.
    balance_by_replay`); ours and torch's rows of one layout and ``M`` share it. Measured at
    the micro-batch size, not the batch's, because small batches do not cost a fixed share
    (the CNN's best interleaved cut is [2, 1, 1, 2] at M = 4 and [1, 1, 2, 2] at M = 8)."""
    layouts = {
        "pipeline": (k, lambda s: s, [(GPIPE, 1), (ONE_F_ONE_B, 1), (ZERO_BUBBLE, 1)]),
        "interleaved": (k * v, INTERLEAVED.placement(k), [(INTERLEAVED, v)]),
        "zbv": (2 * k, ZBV.placement(k), [(ZBV, 2)]),
    }
    counts = sorted({1, *chunks})
    costs: dict = {}
    if workload == "cnn":
        # forward + backward per layer in CPU time (wall time moves with other processes'
        # load), per micro-batch, measured on rank 0 and shared so every rank cuts alike
        box = [{m: [c * m for c in layer_times(base, x.tensor_split(m)[0], repeat=7,
                                               clock=time.thread_time)]
                for m in counts} if rank == 0 else None]  # fmt: skip
        dist.broadcast_object_list(box, 0)
        costs = box[0]
    cuts: dict[str, dict[int, list[int]]] = {}
    for name, (n, where, kinds) in layouts.items():
        cuts[name] = {}
        for m in counts:
            naive = m == 1 and name == "pipeline"  # M = 1: the naive row (GPipe)
            todo = [(GPIPE, 1)] if naive else kinds
            plans = [s.steps(k, m, vv) for s, vv in todo if runs(s, m, k)]
            if not plans and name != "pipeline":
                continue
            if workload == "linear":  # identical layers: equal parameters are equal work
                cuts[name][m] = balance_by_params(base, n)
            else:
                cuts[name][m] = balance_by_replay(costs[m], plans, n, where)
    return cuts


def _pipelines(rank: int, world_size: int, workload: str, chunks: list[int], warmup: int,
               steps: int, rounds: int, virtual: int = 2,
               keep_memory: bool = False) -> dict:  # fmt: skip
    if keep_memory:  # every contender of this process alike, ours and torch's
        keep_freed_memory()
    torch.set_num_threads(1)
    base, x, y, loss_fn = WORKLOADS[workload]()
    balances = _balances(workload, base, x, world_size, virtual, chunks, rank)
    results: dict = {"balance": balances["pipeline"][max(chunks)], "balances": balances,
                     "runs": [], "saved_bytes": {}}  # fmt: skip
    same = (base, balances, rank, world_size, virtual, x, y, loss_fn)

    def ours(schedule: Schedule, m: int, mode: str = "never"):
        module = split_sequential(copy.deepcopy(base), balances["pipeline"][m])[rank]
        stage = PipelineStage(module, Communicator(trace=CommTrace(rank)), checkpoint=mode)
        opt = torch.optim.SGD(module.parameters(), lr=1e-3)
        return stage, opt, lambda: forward_backward(stage, x, y, loss_fn, m, schedule)

    def theirs(kind: str, m: int):
        from torch.distributed import pipelining

        balance = balances["pipeline"][m]
        module = split_sequential(copy.deepcopy(base), balance)[rank]
        micro = _stage_input(base, balance, rank, x.tensor_split(m)[0])
        stage = pipelining.PipelineStage(
            module, rank, world_size, torch.device("cpu"), input_args=(micro,)
        )
        schedule = getattr(pipelining, kind)(stage, n_microbatches=m, loss_fn=loss_fn)
        opt = torch.optim.SGD(module.parameters(), lr=1e-3)
        if rank == 0:
            return None, opt, lambda: schedule.step(x)
        return None, opt, lambda: schedule.step(target=y)

    contenders = [("naive", 1, ours(GPIPE, 1))]
    contenders += [(s.name, m, ours(s, m)) for s in OURS for m in chunks]
    contenders += [(s.name, m, ours_v(s, m, *same)) for s in OURS_V for m in chunks
                   if runs(s, m, world_size)]  # fmt: skip
    contenders += [(f"torch {k}", m, theirs(k, m)) for k in TORCH_SCHEDULES for m in chunks]
    contenders += [(f"torch {k}", m, theirs_v(k, m, *same)) for k in TORCH_V_SCHEDULES
                   for m in chunks]  # fmt: skip
    # rounds interleave the contenders, so that load from other processes hits all alike
    best = [float("inf")] * len(contenders)
    cpu = [float("inf")] * len(contenders)
    for _ in range(rounds):
        for i, (_, _, (stage, opt, step)) in enumerate(contenders):
            if stage is not None:
                stage.comm.trace.clear()  # keep the last round's steps for the bubble
            wall, thread = _time_steps(step, opt, warmup, steps)
            best[i], cpu[i] = min(best[i], wall), min(cpu[i], thread)
    for (name, m, (stage, _, _)), seconds, cpu_s in zip(contenders, best, cpu):
        run = {"name": name, "chunks": m, "step_s": seconds, "cpu_s": cpu_s}
        if stage is not None:
            first = stage.step_index - steps
            sent = [msg for msg in stage.comm.trace.sent() if msg.step >= first]
            run.update(trace=stage.comm.trace, first_step=first,
                       messages_per_step=len(sent) / steps,
                       bytes_per_step=sum(msg.nbytes for msg in sent) / steps)  # fmt: skip
        results["runs"].append(run)
    for run, (_, _, (stage, _, step)) in zip(results["runs"], contenders):
        if stage is not None:  # one more step, counting the activations saved for backward
            stage.measure_memory()
            step()
            run["peak_saved_bytes"] = stage.saved.peak

    for mode in CHECKPOINT_MODES:
        stage, opt, step = ours(GPIPE, max(chunks), mode)
        stage.measure_memory()
        step()
        results["saved_bytes"][mode] = stage.saved.nbytes
    return results


def _imbalance_floor(device_cpu: list[float]) -> float:
    """The bubble that unequal devices leave even under a perfect schedule: while the
    busiest device works, the others finish their share and wait,
    ``1 - mean / max`` of the devices' CPU per step (``imbalance_floor``)."""
    return 1.0 - sum(device_cpu) / (len(device_cpu) * max(device_cpu))


def _with_measured_costs(traces: list, steps: range, kind: Schedule, k: int, m: int,
                         v: int) -> dict:  # fmt: skip
    """The row's schedule replayed with the costs its steps measured (free messages):
    ``theory_bubble_measured_costs``, beside the formula's ``theory_bubble`` (which assumes
    the textbook costs), and the mean span per op, ``mean_step_ms``."""
    schedule = kind.steps(k, m, v)
    replayed = [replayed_bubble(traces, n, schedule, k * v) for n in steps]
    costs = [mean_costs(traces, n) for n in steps]
    return {
        "theory_bubble_measured_costs": sum(replayed) / len(replayed),
        "mean_step_ms": {op: 1e3 * sum(c[op] for c in costs) / len(costs) for op in costs[0]},
    }


def run(workload: str, chunks: list[int], warmup: int, steps: int, rounds: int,
        single_threads: tuple[int, ...] = (1, 2), stages: int = 2,
        virtual: int = 2, keep_memory: bool = False) -> dict:  # fmt: skip
    timing = (warmup, steps, rounds)
    single = {
        t: run_on_ranks(_single, 1, workload, t, *timing, keep_memory, timeout=900)[0]
        for t in single_threads
    }
    ranks = run_on_ranks(_pipelines, stages, workload, chunks, *timing, virtual, keep_memory,
                         timeout=1800)  # fmt: skip
    naive = ranks[0]["runs"][0]["step_s"]
    rows = []
    for i, run0 in enumerate(ranks[0]["runs"]):
        step_s = max(r["runs"][i]["step_s"] for r in ranks)
        row = {"name": run0["name"], "chunks": run0["chunks"], "step_ms": step_s * 1e3,
               "speedup_vs_naive": naive / step_s,
               "stage_cpu_ms": [r["runs"][i]["cpu_s"] * 1e3 for r in ranks],
               "imbalance_floor": _imbalance_floor([r["runs"][i]["cpu_s"] for r in ranks]),
               "virtual_stages": virtual_of(run0["name"], virtual),
               "balance": ranks[0]["balances"][layout_of(run0["name"])][run0["chunks"]],
               "theory_bubble": schedule_of(run0["name"]).bubble(
                   stages, run0["chunks"], virtual_of(run0["name"], virtual))}  # fmt: skip
        if "trace" in run0:
            row["peak_saved_bytes"] = [r["runs"][i]["peak_saved_bytes"] for r in ranks]
            row["messages_per_step"] = [r["runs"][i]["messages_per_step"] for r in ranks]
            row["bytes_per_step"] = [r["runs"][i]["bytes_per_step"] for r in ranks]
            traces = [r["runs"][i]["trace"] for r in ranks]
            first = run0["first_step"]
            bubbles = [measured_bubble(traces, first + k) for k in range(steps)]
            row["measured_bubble"] = sum(bubbles) / len(bubbles)
            row.update(
                _with_measured_costs(
                    traces,
                    range(first, first + steps),
                    schedule_of(run0["name"]),
                    stages,
                    run0["chunks"],
                    row["virtual_stages"],
                )
            )
            # the distance to the formula, in two parts: what the schedule loses with the
            # measured step costs (unequal stages, B/W not equal thirds), and what the run
            # lost on top of that replay (messages, the loop, other processes)
            row["bubble_gap_costs"] = row["theory_bubble_measured_costs"] - row["theory_bubble"]
            row["bubble_gap_runtime"] = row["measured_bubble"] - row["theory_bubble_measured_costs"]
        rows.append(row)
    best_torch = min(r["step_ms"] for r in rows if r["name"].startswith("torch"))
    by_name = {(r["name"], r["chunks"]): r["step_ms"] for r in rows}
    for row in rows:
        row["speedup_vs_torch_best"] = best_torch / row["step_ms"]
        peer = by_name.get(({**PEERS, **PEERS_V}.get(row["name"]), row["chunks"]))
        if peer is not None:  # torch's same schedule at the same chunks over ours
            row["speedup_vs_torch_peer"] = peer / row["step_ms"]
    return {
        "workload": workload,
        "stages": stages,
        "keep_freed_memory": keep_memory,
        "goals": _goals(rows),
        "balance": ranks[0]["balance"],
        "balances": ranks[0]["balances"],
        "single_process_ms": {
            f"{t}_thread{'s' if t > 1 else ''}": s * 1e3 for t, s in single.items()
        },
        "rows": rows,
        "saved_activation_bytes_per_stage": {
            mode: [r["saved_bytes"][mode] for r in ranks] for mode in CHECKPOINT_MODES
        },
        "saved_at_chunks": max(chunks),
    }


def _goals(rows: list[dict]) -> dict:
    """The issue's speed goals from one run: our fastest row against torch's fastest
    ``ScheduleGPipe`` row and torch's fastest row, and how far CPU time lets any schedule of
    ours go: ``cpu_bound_ms``, the busiest device's CPU per step (a step cannot be shorter
    even with no bubble and free messages) of our row whose busiest device is cheapest."""
    ours = [r for r in rows if not r["name"].startswith("torch") and r["name"] != "naive"]
    theirs = [r for r in rows if r["name"].startswith("torch")]
    best = min(ours, key=lambda r: r["step_ms"])
    gpipe = min((r for r in theirs if r["name"] == "torch ScheduleGPipe"),
                key=lambda r: r["step_ms"])  # fmt: skip
    top = min(theirs, key=lambda r: r["step_ms"])
    bound = min(ours, key=lambda r: max(r["stage_cpu_ms"]))
    return {
        "ours_best": [best["name"], best["chunks"], best["step_ms"]],
        "torch_gpipe_best": [gpipe["chunks"], gpipe["step_ms"]],
        "torch_best": [top["name"], top["chunks"], top["step_ms"]],
        "best_vs_torch_gpipe": gpipe["step_ms"] / best["step_ms"],
        "best_vs_torch_best": top["step_ms"] / best["step_ms"],
        "cpu_bound_ms": [bound["name"], bound["chunks"], max(bound["stage_cpu_ms"])],
        "cpu_bound_vs_torch_gpipe": gpipe["step_ms"] / max(bound["stage_cpu_ms"]),
    }


def report(result: dict) -> str:
    cuts = "; ".join(f"{k} " + ", ".join(f"M={m}: {c}" for m, c in v.items())
                     for k, v in result.get("balances", {}).items())  # fmt: skip
    kept = "; freed memory kept" if result.get("keep_freed_memory") else ""
    lines = [f"## {result['workload']} (balance {result['balance']}; cuts: {cuts}{kept})", ""]
    single = ", ".join(
        f"{k.replace('_', ' ')} {v:.1f} ms" for k, v in result["single_process_ms"].items()
    )
    lines += [f"one process: {single}", ""]
    g = result["goals"]
    best, gpipe, top, bound = (
        g["ours_best"],
        g["torch_gpipe_best"],
        g["torch_best"],
        g["cpu_bound_ms"],
    )
    lines += [
        f"our best: {best[0]} M={best[1]} {best[2]:.1f} ms; {g['best_vs_torch_gpipe']:.2f}x "
        f"torch's best ScheduleGPipe (M={gpipe[0]}, {gpipe[1]:.1f} ms; goal >= 1.15x); "
        f"{g['best_vs_torch_best']:.2f}x torch's best ({top[0]} M={top[1]}; goal >= 1.0x)",
        "",
        f"CPU bound: {bound[0]} M={bound[1]}'s busiest device, {bound[2]:.0f} ms per step, "
        f"{g['cpu_bound_vs_torch_gpipe']:.2f}x torch's best ScheduleGPipe step (a step is "
        "never shorter than its busiest device's CPU time: quiet, this caps our speed-up)",
        "",
    ]
    lines.append(
        "| run | M | step (ms) | vs naive | vs torch peer | vs best torch | bubble measured "
        "| theory | theory (measured costs) | gap: costs / runtime | imbalance floor "
        "| CPU/stage (ms) "
        "| peak saved/stage (MiB) | messages/stage |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        measured = f"{r['measured_bubble']:.0%}" if "measured_bubble" in r else "-"
        peer = f"{r['speedup_vs_torch_peer']:.2f}x" if "speedup_vs_torch_peer" in r else "-"
        replayed = r.get("theory_bubble_measured_costs")
        replayed = "-" if replayed is None else f"{replayed:.0%}"
        gaps = (f"{r['bubble_gap_costs']:+.3f} / {r['bubble_gap_runtime']:+.3f}"
                if "bubble_gap_costs" in r else "-")  # fmt: skip
        lines.append(
            f"| {r['name']} | {r['chunks']} | {r['step_ms']:.1f} | {r['speedup_vs_naive']:.2f}x "
            f"| {peer} | {r['speedup_vs_torch_best']:.2f}x | {measured} "
            f"| {r['theory_bubble']:.0%} | {replayed} | {gaps} | {r['imbalance_floor']:.3f} "
            f"| {'/'.join(f'{c:.0f}' for c in r['stage_cpu_ms'])} "
            f"| {'/'.join(f'{b / 2**20:.1f}' for b in r.get('peak_saved_bytes', [])) or '-'} "
            f"| {'/'.join(f'{n:g}' for n in r.get('messages_per_step', [])) or '-'} |"
        )
    lines += [
        "",
        f"saved activations per stage at M={result['saved_at_chunks']} (GPipe schedule):",
        "",
    ]
    k = len(next(iter(result["saved_activation_bytes_per_stage"].values())))
    lines += ["| checkpoint | " + " | ".join(f"stage {s}" for s in range(k)) + " |",
              "|---" * (k + 1) + "|"]  # fmt: skip
    for mode, per_stage in result["saved_activation_bytes_per_stage"].items():
        lines.append(f"| {mode} | " + " | ".join(f"{b / 2**20:.1f} MiB" for b in per_stage) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_par.bench pipeline")
    parser.add_argument("--workload", default="linear,cnn", help="comma list of linear, cnn")
    parser.add_argument("--chunks", default="2,4,8", help="micro-batch counts to compare")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the best one counts")
    parser.add_argument(
        "--single-threads",
        default="1,2",
        help="thread counts of the one-process reference (a forked child can only use more "
        "than one if this process has not started OpenMP threads yet)",
    )
    parser.add_argument("--stages", type=int, default=2, help="pipeline devices K (processes)")
    parser.add_argument("--virtual-stages", type=int, default=2,
                        help="stages per device of the interleaved schedules, v")  # fmt: skip
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="every process keeps freed memory mapped (glibc mallopt; see "
                        "lightning_par.bench.malloc): no page faults re-mapping each step's "
                        "activations, for every contender alike")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = parser.parse_args(argv)
    chunks = [int(c) for c in args.chunks.split(",")]
    workloads = args.workload.split(",")
    threads = tuple(int(t) for t in args.single_threads.split(","))
    if args.stages < 2 or args.virtual_stages < 1:
        parser.error("--stages must be >= 2 and --virtual-stages >= 1")
    results = [run(w, chunks, args.warmup, args.steps, args.rounds, threads, args.stages,
                   args.virtual_stages, args.keep_freed_memory) for w in workloads]  # fmt: skip
    print(json.dumps(results, indent=2) if args.json else "\n\n".join(map(report, results)))
    return 0
