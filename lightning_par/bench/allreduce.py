"""Benchmark the allreduce collectives against ``torch.distributed.all_reduce`` (same run).

    python -m lightning_par.bench allreduce --world-size 4 --sizes 1024 16777216 --repeats 10

For each size and algorithm: median time, bus bandwidth (``2 (p-1)/p * bytes / time``, the
NCCL-tests convention, so algorithms compare on one scale), bytes sent per rank (measured
from a trace and predicted by the cost model) and the ratio of torch's time to ours
(> 1: ours is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from functools import partial

import torch
import torch.distributed as dist

from lightning_par.collectives import ALGORITHMS
from lightning_par.collectives.cost_model import predict
from lightning_par.comm import CommTrace, run_on_ranks


def _time_interleaved(candidates: dict, tensor: torch.Tensor, repeats: int) -> dict:
    """Median seconds per candidate; repeats interleave the candidates so that a change
    in machine load (the CI machine is shared) hits all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            dist.barrier()
            start = time.perf_counter()
            fn(tensor)
            times[name].append(time.perf_counter() - start)
    out = {}
    for name, values in times.items():
        # A collective takes as long as its slowest rank.
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[name] = statistics.median(t.tolist())
    return out


def default_repeats(numel: int) -> int:
    """Repetitions per candidate: many where latency noise dominates; at 1M-4M floats 60,
    since with 10 the ratio of the same command moved by 0.3 between consecutive runs."""
    if numel <= 65536:
        return 200
    return 60 if numel <= 1 << 22 else 20


def _measure(
    rank: int, world_size: int, sizes, algorithms, repeats, warmup, segment_bytes
) -> list[dict]:
    options = {"ring": {"segment_bytes": segment_bytes}} if segment_bytes else {}
    # As Lightning's launchers do: share the cores between the ranks (oversubscribed
    # intra-op threads made a 4M-float add 2.6x slower on the 2-core machine).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    rows = []
    for numel in sizes:
        tensor = torch.ones(numel)
        candidates = {"torch": lambda t: dist.all_reduce(t)}
        for a in algorithms:
            candidates[a] = partial(ALGORITHMS[a], **options.get(a, {}))
        _time_interleaved(candidates, tensor, warmup)
        results = _time_interleaved(candidates, tensor, repeats or default_repeats(numel))
        for name in candidates:
            row = {"numel": numel, "algorithm": name, "median_s": results[name]}
            nbytes = numel * tensor.element_size()
            row["busbw_GBps"] = 2 * (world_size - 1) / world_size * nbytes / results[name] / 1e9
            row["torch_over_ours"] = results["torch"] / results[name]
            if name != "torch":
                trace = CommTrace(rank)
                ALGORITHMS[name](torch.ones(numel), trace=trace, **options.get(name, {}))
                row["bytes_sent_measured"] = trace.bytes_sent
                model = predict(name, numel, world_size, **options.get(name, {}))
                row["bytes_sent_model"] = model.bytes_sent[rank]
                row["messages_measured"] = trace.messages_sent
            rows.append(row)
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_par.bench allreduce")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 65536, 1 << 20, 1 << 24])
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="repetitions per size (default: 200 up to 64K floats, where latency noise "
        "dominates, 60 up to 4M, else 20)",
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--segment-bytes", type=int, default=None, help="ring segment size (default: the ring's)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    args = parser.parse_args(argv)
    if args.world_size < 2:
        parser.error("--world-size must be >= 2")
    if any(n < 1 for n in args.sizes) or (args.repeats is not None and args.repeats < 1):
        parser.error("--sizes and --repeats must be positive")
    rows = run_on_ranks(
        _measure,
        args.world_size,
        args.sizes,
        args.algorithms,
        args.repeats,
        args.warmup,
        args.segment_bytes,
        timeout=600,
    )[0]
    if args.json:
        print(json.dumps({"world_size": args.world_size, "backend": "gloo", "rows": rows}))
        return 0
    repeats = args.repeats or "200 (<= 64K floats) / 60 (<= 4M) / 20"
    print(f"allreduce, gloo, {args.world_size} ranks, median of {repeats} repetitions")
    header = f"{'numel':>10} {'algorithm':>14} {'median ms':>10} {'busbw GB/s':>10}"
    print(header + f" {'torch/ours':>10} {'bytes/rank measured':>20} {'model':>12}")
    for r in rows:
        measured = r.get("bytes_sent_measured", "")
        model = r.get("bytes_sent_model", "")
        print(
            f"{r['numel']:>10} {r['algorithm']:>14} {r['median_s'] * 1e3:>10.3f} "
            f"{r['busbw_GBps']:>10.3f} {r['torch_over_ours']:>10.2f} {measured:>20} {model:>12}"
        )
    return 0
