"""The allreduce benchmarks run and report what they promise (smallest settings; no timing)."""

from __future__ import annotations

import json

from lightning_par.bench import allreduce, strategy


def test_allreduce_benchmark_reports_every_algorithm_and_torch(capsys):
    assert allreduce.main(["--world-size", "3", "--sizes", "10", "--repeats", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["algorithm"]: r for r in out["rows"]}
    assert set(rows) == {"torch", "ring", "tree", "butterfly", "all_to_all", "master_worker"}
    for name, row in rows.items():
        assert row["median_s"] > 0
        if name != "torch":
            assert row["bytes_sent_measured"] == row["bytes_sent_model"] > 0


def test_strategy_benchmark_compares_with_ddp(capsys):
    argv = ["--steps", "3", "--warmup", "1", "--width", "4", "--num-blocks", "1"]
    assert strategy.main([*argv, "--batch-size", "4", "--algorithms", "ring", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    names = [r["strategy"] for r in out["rows"]]
    assert names == ["ddp", "ring_allreduce"]
    assert out["rows"][0]["ratio_to_ddp"] == 1.0 and out["rows"][1]["median_step_s"] > 0
