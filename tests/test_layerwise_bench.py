"""Smoke test of ``python -m lightning_par.bench layerwise``: every variant runs in one set of
ranks and the trace breakdown adds up."""

import json

import pytest

from lightning_par.bench.layerwise import main, workload


def test_layerwise_bench_runs(capsys):
    argv = ["--time-chunks", "16", "--steps", "1", "--rounds", "2", "--warmup", "0", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    rows = result["rows"]
    assert [(r["variant"], r["chunks"]) for r in rows] == [("naive split", 1), ("wavefront", 4)]
    assert result["one_process_s"] > 0 and result["two_at_once_s"] > 0
    for row in rows:
        assert row["step_s"] > 0 and row["one_process_chunked_s"] > 0
        assert 0 < row["utilisation_measured"] <= 1
        # compute and the rest of the step are two parts of the same measured window
        for compute, other in zip(row["compute_s"], row["other_s"]):
            assert compute > 0 and other >= 0
            assert compute + other == pytest.approx(row["window_s"])
        assert row["ideal_s"] >= max(row["compute_s"])
        # each stage holds its own layers: the parameter bytes add up to the model's
        net = workload()[0]
        total = sum(p.numel() * p.element_size() for p in net.parameters())
        assert sum(m["param_bytes"] for m in row["memory"]) == total
        assert all(m["activation_bytes"] > 0 for m in row["memory"])
    # the wavefront sends one activation and one gradient message per chunk (plus the output)
    assert rows[1]["messages_sent"][0] >= rows[1]["chunks"]
