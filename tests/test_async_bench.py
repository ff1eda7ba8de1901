"""``python -m lightning_par.bench async`` measures what it says: accuracy counted on the test
images it names, and the two synchronous contenders (parameter server, ring allreduce)
training the same weights from the same seed, so only the asynchronous ones may differ."""

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
        assert row["rank_images"] == [4 * 32, 4 * 32]  # --limit-batches caps each worker
        correct = row["test_acc"] * 4 * 32  # a count of correct images among 4 x 32 tested
        assert abs(correct - round(correct)) < 1e-3, row
    # synchronous SGD is one process's SGD, whichever way the gradients are summed: the
    # same test loss and accuracy (a straggler changes the time, not the weights)
    ps, ring = rows["parameter_server"], rows["ring_allreduce"]
    assert ps["test_acc"] == ring["test_acc"]
    assert abs(ps["test_loss"] - ring["test_loss"]) < 1e-4 * abs(ring["test_loss"])
