"""Smoke test of ``python -m lightning_par.bench async``: every contender runs and reports."""

from __future__ import annotations

import json
import sys

from lightning_par.comm.run import run_bounded


def test_async_bench_reports_every_contender(mini_dir):
    cmd = [sys.executable, "-m", "lightning_par.bench", "async", "--epochs", "1",
           "--limit-batches", "4", "--json"]  # fmt: skip
    done = run_bounded(cmd, timeout=240)
    assert not done.timed_out and done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    rows = {row["strategy"]: row for row in result["rows"]}
    assert list(rows) == [
        "parameter_server", "async_sgd", "async_sgd(staleness=1)", "async_sgd(staleness=4)",
        "local_sgd(period=4)", "ring_allreduce",
    ]  # fmt: skip
    for row in rows.values():
        assert row["images_per_s"] > 0 and row["train_s"] > 0
        assert 0 <= row["test_acc"] <= 1
        assert row["rank_images"] == [4 * 32, 4 * 32]  # --limit-batches caps each worker
    assert rows["parameter_server"]["speedup_vs_parameter_server"] == 1.0
