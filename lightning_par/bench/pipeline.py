"""Pipeline benchmark: naive split vs our five schedules vs torch.distributed.pipelining.

``python -m lightning_par.bench pipeline [--workload linear,cnn] [--chunks 2,4,8]
[--stages 2] [--virtual-stages 2] [--json]``

``K = --stages`` devices (processes, gloo, one thread each so that two stages share the
two cores of the reference machine fairly), the same model for every contender, cut into
``K`` stages (``K*v`` for the interleaved ones, the same cut for ours and torch's), in one
run:

* one process on the whole model (1 thread and 2 threads) for context;
* the naive split (``M = 1``: one stage works while the other waits);
* our GPipe, 1F1B, interleaved 1F1B (``v`` stages per device), zero bubble (ZB-H1 order,
  B/W split) and ZBV (two stages per device in a V, B/W split) for several ``M``, all on the
  one stage runtime :class:`~lightning_par.pipeline.multistage.DeviceStages`
  (:mod:`._pipeline_contenders`; ``checkpoint="never"``: no recomputation, like torch's
  schedules), each row's ``theory_bubble`` its own formula
  (:meth:`~lightning_par.pipeline.schedules.Schedule.bubble`) beside the bubble measured
  from the traces and the schedule replayed with the step costs the traces measured
  (``theory_bubble_measured_costs``,
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
  ``ScheduleInterleavedZeroBubble`` and ``ScheduleZBVZeroBubble`` on the same stages (or
  those ``--peers`` names), each the peer of our schedule of the same kind at the same ``M``
  (``speedup_vs_torch_peer``); one that fails on this torch (torch 2.11's V schedules
  stopped with gloo's "Pair is not connected") is a row ``{"name", "failed"}`` and the rest
  is measured (:mod:`._peers`);
* per stage of ours, the peak bytes of activations saved for backward during one step
  (``peak_saved_bytes``, counted with ``saved_tensors_hooks``);
* each stage's CPU time per step (nearly blind to load from other processes) and, for our
  rows, the messages and bytes each stage sent per step;
* activation bytes each stage stores between forward and backward per re-materialisation
  mode at the largest ``M`` (counted with ``saved_tensors_hooks``).

``--keep-freed-memory``: every process keeps freed memory mapped (:mod:`.malloc`), which
removes the page faults of re-allocating each step's activations (10-15 % of the stages' CPU
on the CNN) for every contender alike.

What each process measures: :mod:`._pipeline_timing`; the rows and tables:
:mod:`._pipeline_report`. Output: the run's environment (:mod:`._environment`) and one
result per workload (``--json``: ``{"environment", "workloads": [...]}``).
"""

from __future__ import annotations

import argparse

from lightning_par.bench._environment import RunEnvironment, print_result
from lightning_par.bench._peers import run_with_peers
from lightning_par.bench._pipeline_contenders import (
    TORCH_SCHEDULES,
    cnn_workload,
    linear_workload,
)
from lightning_par.bench._pipeline_report import goals, report, rows
from lightning_par.bench._pipeline_timing import pipelines, single
from lightning_par.comm import run_on_ranks
from lightning_par.pipeline import CHECKPOINT_MODES

__all__ = ["cnn_workload", "linear_workload", "main", "report", "run"]


def run(workload: str, chunks: list[int], warmup: int, steps: int, rounds: int,
        single_threads: tuple[int, ...] = (1, 2), stages: int = 2, virtual: int = 2,
        keep_memory: bool = False, peers: tuple[str, ...] = TORCH_SCHEDULES) -> dict:  # fmt: skip
    """One workload's benchmark: the one-process references, then every contender on
    ``stages`` processes, torch's ``peers`` among them (see the module docstring)."""
    timing = (warmup, steps, rounds)
    alone = {
        t: run_on_ranks(single, 1, workload, t, *timing, keep_memory, timeout=900)[0]
        for t in single_threads
    }
    ranks, failed = run_with_peers(pipelines, stages, workload, chunks, *timing, virtual,
                                   keep_memory, peers, timeout=1800)  # fmt: skip
    table = rows(ranks, stages, steps, virtual, failed)
    return {
        "workload": workload,
        "stages": stages,
        "keep_freed_memory": keep_memory,
        "goals": goals(table),
        "balance": ranks[0]["balance"],
        "balances": ranks[0]["balances"],
        "single_process_ms": {
            f"{t}_thread{'s' if t > 1 else ''}": s * 1e3 for t, s in alone.items()
        },
        "rows": table,
        "saved_activation_bytes_per_stage": {
            mode: [r["saved_bytes"][mode] for r in ranks] for mode in CHECKPOINT_MODES
        },
        "saved_at_chunks": max(chunks),
    }


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
    parser.add_argument("--peers", default=",".join(TORCH_SCHEDULES),
                        help="comma list of torch's schedules to run beside ours")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = parser.parse_args(argv)
    peers = tuple(p for p in args.peers.split(",") if p)
    if set(peers) - set(TORCH_SCHEDULES):
        parser.error(f"--peers: choose from {', '.join(TORCH_SCHEDULES)}")
    chunks = [int(c) for c in args.chunks.split(",")]
    workloads = args.workload.split(",")
    threads = tuple(int(t) for t in args.single_threads.split(","))
    if args.stages < 2 or args.virtual_stages < 1:
        parser.error("--stages must be >= 2 and --virtual-stages >= 1")
    started = RunEnvironment.now()
    results = [run(w, chunks, args.warmup, args.steps, args.rounds, threads, args.stages,
                   args.virtual_stages, args.keep_freed_memory, peers)
               for w in workloads]  # fmt: skip
    print_result({"workloads": results}, lambda r: "\n\n".join(map(report, r["workloads"])),
                 args.json, started, indent=2)  # fmt: skip
    return 0
