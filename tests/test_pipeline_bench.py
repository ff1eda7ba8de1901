"""``python -m lightning_par.bench pipeline`` measures what it says: each of our schedules
sends one activation and one gradient message per micro-batch, carrying exactly the batch's
activations at the cut, torch's two schedules run as the peers of ours, and the theory
column is GPipe's bubble (K-1)/(M+K-1)."""

import json

from lightning_par.bench.pipeline import main


def test_pipeline_bench_counts_the_schedules_messages(capsys):
    argv = ["--workload", "linear", "--chunks", "2,4", "--steps", "1", "--rounds", "1"]
    # one thread only: earlier tests started OpenMP threads in this process, which a forked
    # child cannot use
    assert main(argv + ["--warmup", "1", "--single-threads", "1", "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)
    rows = {(row["name"], row["chunks"]): row for row in result["rows"]}
    assert list(rows) == [
        ("naive", 1), ("gpipe", 2), ("gpipe", 4), ("1f1b", 2), ("1f1b", 4),
        ("torch ScheduleGPipe", 2), ("torch ScheduleGPipe", 4),
        ("torch Schedule1F1B", 2), ("torch Schedule1F1B", 4),
    ]  # fmt: skip
    # the Linear stack is cut between two Linear(1024) layers: a 256 x 1024 float batch
    cut_bytes = 256 * 1024 * 4
    for (name, m), row in rows.items():
        assert row["theory_bubble"] == 1 / (m + 1)
        assert len(row["stage_cpu_ms"]) == 2
        if name.startswith("torch"):
            assert "messages_per_step" not in row
            continue
        # stage 0 sends M activations forward, stage 1 M gradients back, every timed step
        # (shape headers went once, in the first warm-up step), together the whole batch
        assert row["messages_per_step"] == [m, m], (name, m)
        assert row["bytes_per_step"] == [cut_bytes, cut_bytes], (name, m)
        peer = rows.get(({"gpipe": "torch ScheduleGPipe", "1f1b": "torch Schedule1F1B"}
                         .get(name), m))  # fmt: skip
        if peer is not None:
            assert row["speedup_vs_torch_peer"] == peer["step_ms"] / row["step_ms"]
    saved = result["saved_activation_bytes_per_stage"]
    assert all(a < n for a, n in zip(saved["always"], saved["never"]))
