"""Smoke test of ``python -m lightning_par.bench local_sgd``: every contender runs and reports."""

import json

from lightning_par.bench.local_sgd import main


def test_local_sgd_bench_runs(capsys, mini_dir):
    argv = ["--epochs", "1", "--limit-batches", "8", "--slowdowns", "3", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {row["strategy"]: row for row in result["rows"]}
    assert list(rows) == ["ring_allreduce", "local_sgd(period=4)", "local_sgd(period=None)"]
    for row in rows.values():
        assert row["images_per_s"] > 0 and row["train_s"] > 0
        assert 0 <= row["test_acc"] <= 1
        assert row["rank1_images"] == 8 * 32
    # Measured from the trace: 8 gradient allreduces, 2 averagings, 1 averaging.
    sent = {name: row["rank0_bytes_sent"] for name, row in rows.items()}
    assert sent["ring_allreduce"] > 3.5 * sent["local_sgd(period=4)"]
    assert 1.8 < sent["local_sgd(period=4)"] / sent["local_sgd(period=None)"] < 2.2
