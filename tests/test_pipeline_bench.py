"""Smoke test of ``python -m lightning_par.bench pipeline``: every contender runs and reports."""

import json

from lightning_par.bench.pipeline import main


def test_pipeline_bench_runs(capsys):
    argv = ["--workload", "linear", "--chunks", "2", "--steps", "1", "--rounds", "1"]
    # one thread only: earlier tests started OpenMP threads in this process, which a forked
    # child cannot use
    assert main(argv + ["--warmup", "0", "--single-threads", "1", "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)
    names = [row["name"] for row in result["rows"]]
    assert names == ["naive", "gpipe", "1f1b", "torch ScheduleGPipe"]
    naive, gpipe = result["rows"][0], result["rows"][1]
    # the bubble measured from the traces: two micro-batches leave less idle time than one
    assert 0 < gpipe["measured_bubble"] < naive["measured_bubble"] < 1
    saved = result["saved_activation_bytes_per_stage"]
    assert all(a < n for a, n in zip(saved["always"], saved["never"]))
