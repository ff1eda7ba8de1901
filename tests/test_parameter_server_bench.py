"""Smoke test of ``python -m lightning_par.bench parameter_server``: every contender runs on
both models, and the measured server-link bytes follow the cost model."""

import json
import os
import sys

from lightning_par.launch.processes import run_bounded


def test_parameter_server_bench_runs(tmp_path):
    cmd = [sys.executable, "-m", "lightning_par.bench", "parameter_server", "--rounds", "1",
           "--steps", "5", "--warmup", "2", "--width", "256", "--batch", "8", "--json"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "TMPDIR": str(tmp_path)}
    done = run_bounded(cmd, timeout=240, env=env)
    assert done.returncode == 0 and not done.timed_out, done.stderr[-3000:]
    # the report only: at most one line per fit (8 fits), none of Lightning's start-up lines
    assert len(done.stderr.splitlines()) <= 8, done.stderr[-3000:]
    assert "GPU available" not in done.stderr and "val_dataloader" not in done.stderr
    assert not [p for p in tmp_path.iterdir() if not p.name.startswith("torchinductor")]
    rows = {(r["model"], r["strategy"]): r for r in json.loads(done.stdout)["rows"]}
    for model in ("wide_mlp", "cnn"):
        for name in ("parameter_server(S=1)", "parameter_server(S=2)", "ring_allreduce",
                     "lightning_ddp"):  # fmt: skip
            assert rows[model, name]["step_s"] > 0
            # CPU per step of worker 0's process, against the ring's
            assert rows[model, name]["worker0_cpu_step_s"] > 0
            ring_cpu = rows[model, "ring_allreduce"]["worker0_cpu_step_s"]
            assert (
                rows[model, name]["cpu_vs_ring"]
                == rows[model, name]["worker0_cpu_step_s"] / ring_cpu
            )
        one, two = rows[model, "parameter_server(S=1)"], rows[model, "parameter_server(S=2)"]
        model_2wn = one["cost_model_one_server_bytes"]
        # one server carries 2·W·n per step (plus a flag per slice and the headers)
        assert 0 <= one["busiest_link_bytes_per_step"] - model_2wn < 0.01 * model_2wn
        # two servers share it: the busier carries about half
        assert abs(two["busiest_link_bytes_per_step"] - model_2wn / 2) < 0.1 * model_2wn / 2
