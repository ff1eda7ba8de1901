"""``python -m lightning_par.bench async`` measures what it says: each seed's images/s from
the images the workers trained, accuracy counted on the test images it names, every ratio
against the reference run of the same seed, the seeds really changing the run, and the two
synchronous contenders (parameter server, ring allreduce) training the same weights."""

from __future__ import annotations

import json
import statistics
import sys

import pytest

from lightning_par.launch.processes import run_bounded

CONTENDERS = ["parameter_server", "async_sgd", "ring_allreduce"]


def test_async_bench_rows_are_what_the_runs_measured(mini_dir):
    cmd = [sys.executable, "-m", "lightning_par.bench", "async", "--epochs", "1",
           "--limit-batches", "4", "--seeds", "0,1", "--strategies", ",".join(CONTENDERS),
           "--json"]  # fmt: skip
    done = run_bounded(cmd, timeout=240)
    assert not done.timed_out and done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    rows = {row["strategy"]: row for row in result["rows"]}
    assert list(rows) == CONTENDERS and result["seeds"] == [0, 1]
    ps = rows["parameter_server"]["seeds"]
    for row in rows.values():
        runs = row["seeds"]
        assert [r["seed"] for r in runs] == [0, 1]
        for r in runs:
            assert r["rank_images"] == [4 * 32, 4 * 32]  # --limit-batches caps each worker
            assert r["images_per_s"] == pytest.approx(sum(r["rank_images"]) / r["train_s"])
            correct = r["test_acc"] * 4 * 32  # a count of correct images among 4 x 32 tested
            assert abs(correct - round(correct)) < 1e-3, r
        # the summary is the mean over the seeds, each ratio against the same seed's reference
        speedups = [r["images_per_s"] / q["images_per_s"] for r, q in zip(runs, ps)]
        points = [100 * (r["test_acc"] - q["test_acc"]) for r, q in zip(runs, ps)]
        assert row["speedup_vs_parameter_server"] == pytest.approx(statistics.mean(speedups))
        assert row["speedup_vs_parameter_server_min"] == pytest.approx(min(speedups))
        assert row["acc_points_vs_parameter_server"] == pytest.approx(statistics.mean(points))
        assert row["test_acc"] == pytest.approx(statistics.mean(r["test_acc"] for r in runs))
        assert row["test_acc_min"] <= row["test_acc"] <= row["test_acc_max"]
    # another seed is another initialisation and order: another test loss
    assert ps[0]["test_loss"] != ps[1]["test_loss"]
    # synchronous SGD is one process's SGD, whichever way the gradients are summed: the
    # same test loss and accuracy per seed (a straggler changes the time, not the weights)
    for p, ring in zip(ps, rows["ring_allreduce"]["seeds"]):
        assert p["test_acc"] == ring["test_acc"]
        assert abs(p["test_loss"] - ring["test_loss"]) < 1e-4 * abs(ring["test_loss"])
