"""``python -m lightning_par.bench zero`` at its smallest: one row per contender with what it
names measured, the memory held by our contenders exactly the cost model's and within 10 %
of the paper's formula, the bytes sent the cost model's, and a failed peer (torch's
``fully_shard``) a row."""

import json

from lightning_par.bench.zero import CONTENDERS, main, rows_for

SMALL = ["--world-sizes", "2", "--steps", "1", "--warmup", "1", "--rounds", "1",
         "--mlp-width", "96", "--mlp-depth", "2", "--cnn-width", "4", "--cnn-blocks", "1",
         "--json"]  # fmt: skip
MEASURED = ("median_step_s", "params_bytes", "grads_bytes", "optimizer_bytes", "buffers_bytes",
            "model_states_bytes", "formula_bytes", "held_vs_formula", "peak_bytes")  # fmt: skip


def test_bench_zero_rows_at_the_smallest_setting(capsys):
    assert main(SMALL) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["rows"]
    assert doc["environment"]["torch"] and doc["backend"] == "gloo"
    assert [(r["model"], r["contender"]) for r in rows] == [
        (m, c) for m in ("cnn", "mlp") for c in CONTENDERS
    ]
    for row in rows:
        assert "failed" not in row, row
        assert all(key in row for key in MEASURED), row
        assert row["steps_timed"] == 1 and row["median_step_s"] > 0
        # the step's peak is at least what it holds after backward
        assert row["peak_bytes"] >= row["model_states_bytes"] + row["buffers_bytes"]
        if row["contender"] == "fully_shard":
            assert row["speed_vs_fully_shard"] == 1.0
            continue
        assert row["memory_goal_met"] and abs(row["held_vs_formula"] - 1) <= 0.10, row
        assert row["held_is_exact"] and row["sent_matches_model"], row
        assert row["bytes_sent_per_step"] == row["bytes_sent_model"]
        assert (row["buffers_bytes"] > 0) == (row["stage"] <= 1)
    by = {(r["model"], r["contender"]): r for r in rows}
    for model in ("cnn", "mlp"):
        ring, zero3 = by[model, "ring_allreduce"], by[model, "zero3"]
        # stage 3 holds a p-th of the model states, and gathers the weights twice a step
        assert zero3["model_states_bytes"] < 0.6 * ring["model_states_bytes"]
        assert 1.4 < zero3["sent_vs_ring"] < 1.6
        assert "step_goal_met" in by[model, "zero1"] and "step_goal_met" in zero3


def test_a_failed_peer_is_a_row_saying_so():
    results: list[dict] = [{}, {}]  # the ranks measured nothing of it
    failed = {"mlp/fully_shard": "rank 0: RuntimeError: gloo timed out"}
    (row,) = rows_for("mlp", 2, results, ["fully_shard"], failed)
    assert row == {"model": "mlp", "world_size": 2, "contender": "fully_shard", "stage": 3,
                   "failed": "rank 0: RuntimeError: gloo timed out"}  # fmt: skip
