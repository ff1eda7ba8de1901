"""The allreduce benchmarks run and report what they promise (smallest settings; no timing)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from lightning_par.bench.allreduce import default_repeats
from lightning_par.collectives import ALGORITHMS
from lightning_par.launch.processes import run_bounded


def run_bench(*argv: str) -> dict:
    """``python -m lightning_par.bench ... --json`` in a fresh interpreter (its ranks fork
    from a parent that has not started an OpenMP pool, as in real use)."""
    cmd = [sys.executable, "-m", "lightning_par.bench", *argv, "--json"]
    done = run_bounded(cmd, timeout=240)
    assert not done.timed_out and done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_allreduce_benchmark_reports_every_algorithm_and_torch():
    out = run_bench("allreduce", "--world-size", "3", "--sizes", "10", "--repeats", "1")
    assert out["environment"]["cores"] == os.cpu_count()
    rows = {r["algorithm"]: r for r in out["rows"]}
    assert set(rows) == {"torch", *ALGORITHMS}
    assert {"ring", "tree", "butterfly", "round_robin"} <= set(rows)
    for name, row in rows.items():
        assert row["median_s"] > 0
        if name != "torch":
            assert row["bytes_sent_measured"] == row["bytes_sent_model"] > 0


def test_default_repetitions_grow_where_one_call_is_short():
    assert default_repeats(65536) == default_repeats(1 << 22) == 200  # latency-bound sizes
    assert default_repeats((1 << 22) + 1) == default_repeats(1 << 24) == 40


def test_gloo_loop_script_sums_like_all_reduce_at_every_size():
    # the script checks each candidate's sum against dist.all_reduce before timing it, and
    # exits non-zero if one differs; sizes below 4 leave some of its pieces empty
    script = Path(__file__).parents[1] / "benchmarks" / "gloo_loop_p2.py"
    sizes = ["1", "3", "10", "4097"]
    cmd = [sys.executable, str(script), "--sizes", *sizes, "--repeats", "1", "--json"]
    done = run_bounded(cmd, timeout=240)
    assert not done.timed_out and done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])["rows"]
    assert [(r["numel"], r["algorithm"]) for r in rows] == [
        (int(n), name) for n in sizes for name in ("torch", "ring", "gloo_loop")
    ]
    for r in rows:
        assert r["median_s"] > 0
        ratio = r["torch_over_ours"]
        assert ratio == 1.0 if r["algorithm"] == "torch" else ratio > 0


def test_strategy_benchmark_compares_with_ddp():
    argv = ["--steps", "3", "--warmup", "1", "--width", "4", "--num-blocks", "1"]
    out = run_bench("strategy", *argv, "--batch-size", "4", "--algorithms", "ring")
    ddp, ring = out["rows"]
    assert (ddp["strategy"], ring["strategy"]) == ("lightning_ddp", "ring_allreduce")
    for row in (ddp, ring):
        assert row["steps_timed"] == 2 and row["workers"] == 2
        assert row["min_step_s"] <= row["median_step_s"] <= row["max_step_s"]
        # the launch policy: a script forks only when each rank gets one core anyway
        assert row["start_method"] == ("fork" if (os.cpu_count() or 1) // 2 <= 1 else "popen")
    assert abs(ring["ratio_to_ddp"] - ring["median_step_s"] / ddp["median_step_s"]) < 1e-12


def test_a_benchmark_past_its_time_limit_is_stopped_with_its_ranks():
    # 400 steps of a 32-wide CNN take well over 8 s (a 4-wide one took about 8 s on a quiet
    # 2-core machine and sometimes finished in time)
    argv = ["strategy", "--steps", "400", "--warmup", "1", "--width", "32", "--num-blocks", "2"]
    env = {**os.environ, "LIGHTNING_PAR_BENCH_TIMEOUT": "8"}
    cmd = [sys.executable, "-m", "lightning_par.bench", *argv, "--algorithms", "ring"]
    done = run_bounded(cmd, timeout=120, env=env)
    assert not done.timed_out, "the benchmark's own limit did not stop it"
    assert done.returncode != 0
    assert "ran past its 8 s limit" in done.stderr


def test_a_reference_that_fails_is_a_row_and_the_strategies_are_still_timed(monkeypatch, capsys):
    from lightning_par.bench import strategy

    made = strategy.reference_and_candidates

    def broken_reference(args) -> dict:
        def fails():
            raise RuntimeError("the peer broke\nat length")

        return {**made(args), "lightning_single": fails}  # (same name, same place: first)

    monkeypatch.setattr(strategy, "reference_and_candidates", broken_reference)
    argv = ["--devices", "1", "--steps", "3", "--warmup", "1", "--width", "4", "--num-blocks",
            "1", "--batch-size", "4", "--algorithms", "ring", "--json"]  # fmt: skip
    assert strategy.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    reference, ring, local = out["rows"]
    assert reference == {"strategy": "lightning_single", "failed": "RuntimeError: the peer broke"}
    assert [ring["strategy"], local["strategy"]] == ["ring_allreduce", "local_sgd"]
    for row in (ring, local):  # timed, with nothing to compare to
        assert row["steps_timed"] == 2 and row["speed_vs_reference"] is None
