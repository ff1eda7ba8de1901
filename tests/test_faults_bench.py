"""``python -m lightning_par.bench faults`` as users run it: a rank killed, our survivors
against restarting from a checkpoint, every figure in its row (timings are not asserted:
they live in ``benchmarks/faults.md``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_bench_faults_reports_each_approach_of_a_killed_rank(tmp_path):
    env = {**os.environ, "LIGHTNING_PAR_BENCH_SYNTHETIC": "1", "TMPDIR": str(tmp_path)}
    env["PYTHONPATH"] = str(ROOT)
    args = ["--worlds", "3", "--steps", "12", "--fault-step", "7", "--checkpoint-every", "3",
            "--width", "8", "--num-blocks", "2", "--batch-size", "16"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "lightning_par.bench", "faults", *args, "--json"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout[done.stdout.index("{") :])
    assert result["environment"]["cores"] >= 1 and result["fault_step"] == 7
    assert result["model"] == {"width": 8, "num_blocks": 2, "batch_size": 16}
    ours, restart = result["rows"]
    assert (ours["approach"], restart["approach"]) == ("fault_tolerant", "restart"), result
    assert ours["steps_lost"] == 0 and restart["steps_lost"] == 1, result  # 7 - checkpoint 6
    assert 0 < ours["detect_s"] and 0 < ours["regroup_s"] and "detect_s" not in restart
    for row in (ours, restart):
        assert row["world"] == 3 and row["step_s"] > 0 and row["lost_s"] > -row["step_s"]
        assert row["before_steps_per_s"] > 0 and row["after_steps_per_s"] > 0
    (ratio,) = result["ratios"]
    expected = restart["lost_s"] / max(ours["lost_s"], 1e-3)
    assert ratio["restart_over_fault_tolerant"] == expected
    left = [p.name for p in tmp_path.iterdir() if not p.name.startswith("torchinductor")]
    assert left == [], "left behind"
