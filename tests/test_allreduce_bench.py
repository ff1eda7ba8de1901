"""The allreduce benchmarks run and report what they promise (smallest settings; no timing)."""

from __future__ import annotations

import json
import subprocess
import sys

from lightning_par.collectives import ALGORITHMS


def run_bench(*argv: str) -> dict:
    """``python -m lightning_par.bench ... --json`` in a fresh interpreter (its ranks fork
    from a parent that has not started an OpenMP pool, as in real use)."""
    cmd = [sys.executable, "-m", "lightning_par.bench", *argv, "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_allreduce_benchmark_reports_every_algorithm_and_torch():
    out = run_bench("allreduce", "--world-size", "3", "--sizes", "10", "--repeats", "1")
    rows = {r["algorithm"]: r for r in out["rows"]}
    assert set(rows) == {"torch", *ALGORITHMS}
    assert {"ring", "tree", "butterfly", "round_robin"} <= set(rows)
    for name, row in rows.items():
        assert row["median_s"] > 0
        if name != "torch":
            assert row["bytes_sent_measured"] == row["bytes_sent_model"] > 0


def test_strategy_benchmark_compares_with_ddp():
    argv = ["--steps", "3", "--warmup", "1", "--width", "4", "--num-blocks", "1"]
    out = run_bench("strategy", *argv, "--batch-size", "4", "--algorithms", "ring")
    names = [r["strategy"] for r in out["rows"]]
    assert names == ["ddp", "ring_allreduce"]
    assert out["rows"][0]["ratio_to_ddp"] == 1.0 and out["rows"][1]["median_step_s"] > 0
