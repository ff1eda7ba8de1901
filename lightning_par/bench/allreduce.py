"""Benchmark the allreduce collectives against ``torch.distributed.all_reduce`` (same run).

    python -m lightning_par.bench allreduce --world-size 4 --sizes 1024 16777216 --repeats 10

For each size and algorithm: median time, bus bandwidth (``2 (p-1)/p * bytes / time``, the
NCCL-tests convention, so algorithms compare on one scale), bytes sent per rank (measured
from a trace and predicted by the cost model) and the ratio of torch's time to ours
(> 1: ours is faster). torch's ``all_reduce`` runs on a gloo group of its own; if it fails,
its row says so (``failed``) and ours are still measured (:mod:`._peers`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial

import torch
import torch.distributed as dist

from lightning_par.bench._environment import RunEnvironment, print_result
from lightning_par.bench._peers import PeerGuard, run_with_peers
from lightning_par.collectives import ALGORITHMS, ring_tuning
from lightning_par.collectives.cost_model import predict
from lightning_par.comm import CommTrace

#: The peer: gloo's own allreduce, on a group of its own.
TORCH = "torch"


def _timed(fn, tensor: torch.Tensor) -> float:
    start = time.perf_counter()
    fn(tensor)
    return time.perf_counter() - start


def _time_interleaved(candidates: dict, tensor: torch.Tensor, repeats: int,
                      guard: PeerGuard | None = None) -> dict:  # fmt: skip
    """Median seconds per candidate; repeats interleave the candidates so that a change
    in machine load (the CI machine is shared) hits all of them alike. torch's runs
    through ``guard`` (none: its failure raises); once failed, it is left out."""
    guard = guard or PeerGuard()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            dist.barrier()
            if name != TORCH:
                times[name].append(_timed(fn, tensor))
            elif (took := guard.run(TORCH, lambda fn=fn: _timed(fn, tensor))) is not None:
                times[name].append(took)
    out = {}
    for name, values in times.items():
        if name == TORCH and TORCH in guard.failed:
            continue
        # A collective takes as long as its slowest rank.
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[name] = statistics.median(t.tolist())
    return out


def default_repeats(numel: int) -> int:
    """Repetitions per candidate: many where latency noise dominates. Up to 4M floats 200:
    with 60 the ratio of one command at 1M floats on 2 ranks moved between 0.61 and 1.04
    over six runs on the quiet 2-core machine (2026-11-29), and with 300 between 0.87 and
    0.98; a repetition there takes 4-15 ms. Above, 40."""
    if numel <= 1 << 22:
        return 200
    return 40


def _measure(rank: int, world_size: int, sizes, algorithms, repeats, warmup, segment_bytes,
             calibrate: bool, *, guard: PeerGuard) -> dict:  # fmt: skip
    # As Lightning's launchers do: share the cores between the ranks (oversubscribed
    # intra-op threads made a 4M-float add 2.6x slower on the 2-core machine).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    group = guard.group(TORCH)
    # the ring as the strategies run it: tuned for this machine (all ranks on this host)
    choice = ring_tuning.choose(None, world_size, calibrate_now=calibrate)
    ring = choice.tuning.options() | ({"segment_bytes": segment_bytes} if segment_bytes else {})
    options = {"ring": ring}
    rows = []
    for numel in sizes:
        tensor = torch.ones(numel)
        candidates = {TORCH: lambda t: dist.all_reduce(t, group=group)}
        for a in algorithms:
            candidates[a] = partial(ALGORITHMS[a], **options.get(a, {}))
        _time_interleaved(candidates, tensor, warmup, guard)
        results = _time_interleaved(candidates, tensor, repeats or default_repeats(numel), guard)
        for name in candidates:
            if name not in results:
                rows.append({"numel": numel, "algorithm": name, "failed": guard.failed[name]})
                continue
            row = {"numel": numel, "algorithm": name, "median_s": results[name]}
            nbytes = numel * tensor.element_size()
            row["busbw_GBps"] = 2 * (world_size - 1) / world_size * nbytes / results[name] / 1e9
            if TORCH in results:
                row["torch_over_ours"] = results[TORCH] / results[name]
            if name != TORCH:
                trace = CommTrace(rank)
                ALGORITHMS[name](torch.ones(numel), trace=trace, **options.get(name, {}))
                row["bytes_sent_measured"] = trace.bytes_sent
                shape = dict(options.get(name, {}))
                shape.pop("receives_in_flight", None)  # the bytes and messages do not depend on it
                model = predict(name, numel, world_size, **shape)
                row["bytes_sent_model"] = model.bytes_sent[rank]
                row["messages_measured"] = trace.messages_sent
            rows.append(row)
    described = choice.tuning.describe()
    if segment_bytes:
        described += f"; --segment-bytes {segment_bytes}"
    return {"rows": rows, "ring_tuning": f"{described}: {choice.source}",
            "ring_calibration_ms": choice.medians_ms}  # fmt: skip


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_par.bench allreduce")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 65536, 1 << 20, 1 << 24])
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="repetitions per size (default: 200 up to 4M floats, where latency noise "
        "dominates, else 40)",
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--segment-bytes", type=int, default=None, help="ring segment size (default: the ring's)"
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="time the ring's candidate message sizes on these ranks first and keep the "
        "fastest in the cache folder (default: a kept calibration, else the rule by cores)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    args = parser.parse_args(argv)
    if args.world_size < 2:
        parser.error("--world-size must be >= 2")
    if any(n < 1 for n in args.sizes) or (args.repeats is not None and args.repeats < 1):
        parser.error("--sizes and --repeats must be positive")
    started = RunEnvironment.now()
    ranks, _ = run_with_peers(_measure, args.world_size, args.sizes, args.algorithms,
                              args.repeats, args.warmup, args.segment_bytes, args.calibrate,
                              timeout=600)  # fmt: skip
    result = {"world_size": args.world_size, "backend": "gloo", "repeats": args.repeats,
              **ranks[0]}  # fmt: skip
    print_result(result, report, args.json, started)
    return 0


def report(result: dict) -> str:
    repeats = result["repeats"] or "200 (<= 4M floats) / 40"
    lines = [f"allreduce, gloo, {result['world_size']} ranks, median of {repeats} repetitions",
             f"ring tuning: {result['ring_tuning']}"]  # fmt: skip
    if result.get("ring_calibration_ms"):
        sizes = " / ".join(f"{n} floats" for n in ring_tuning.CALIBRATION_SIZES)
        lines.append(f"  calibration, median ms at {sizes}:")
        for name, ms in result["ring_calibration_ms"].items():
            lines.append(f"    {name:>16}: " + " / ".join(f"{t:.3f}" for t in ms))
    header = f"{'numel':>10} {'algorithm':>14} {'median ms':>10} {'busbw GB/s':>10}"
    lines.append(header + f" {'torch/ours':>10} {'bytes/rank measured':>20} {'model':>12}")
    for r in result["rows"]:
        if "failed" in r:
            lines.append(f"{r['numel']:>10} {r['algorithm']:>14} failed: {r['failed']}")
            continue
        measured = r.get("bytes_sent_measured", "")
        model = r.get("bytes_sent_model", "")
        ratio = f"{r['torch_over_ours']:>10.2f}" if "torch_over_ours" in r else f"{'-':>10}"
        lines.append(
            f"{r['numel']:>10} {r['algorithm']:>14} {r['median_s'] * 1e3:>10.3f} "
            f"{r['busbw_GBps']:>10.3f} {ratio} {measured:>20} {model:>12}"
        )
    return "\n".join(lines)
