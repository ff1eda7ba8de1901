"""``python -m lightning_par.bench faults``'s main as users run it: for each strategy it covers, a
rank (or a parameter server) killed, our survivors against restarting from a checkpoint,
every figure in its row, the survivors' weights those of the run without the fault (timings
are not asserted, beyond a restart losing more time than the survivors: they live in
``benchmarks/faults.md``)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

from lightning_par.bench import _faults_fits
from lightning_par.bench._faults_cases import CASES, cases_for
from lightning_par.bench._faults_fits import LIMIT_S, Plan
from lightning_par.bench._faults_report import report
from lightning_par.bench.faults import bench, main, measure
from lightning_par.launch.processes import Completed

ROOT = Path(__file__).parent.parent
FAULT, EVERY = 5, 3  # the fault as step 5 begins; the restart's checkpoints at steps 3, 6...


def test_bench_faults_reports_each_strategy_losing_a_process(tmp_path, monkeypatch, capsys):
    # (main in this process: its scripts are processes of their own, as users run them)
    monkeypatch.setenv("LIGHTNING_PAR_BENCH_SYNTHETIC", "1")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    args = ["--worlds", "2", "--steps", "12", "--fault-step", str(FAULT), "--checkpoint-every",
            str(EVERY), "--width", "4", "--num-blocks", "1", "--batch-size", "8"]  # fmt: skip
    assert main([*args, "--json"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[out.index("{") :])
    assert result["environment"]["cores"] >= 1 and result["fault_step"] == FAULT
    assert result["model"] == {"width": 4, "num_blocks": 1, "batch_size": 8}
    rows, ratios = result["rows"], result["ratios"]
    assert [(r["strategy"], r["lost"], r["approach"]) for r in rows] == [
        (case.strategy, case.lost, approach)
        for case in CASES for approach in ("fault_tolerant", "restart")
    ], rows  # fmt: skip
    since_checkpoint = FAULT - FAULT // EVERY * EVERY
    for ours, restart in zip(rows[::2], rows[1::2]):
        name = ours["strategy"]
        assert "failed" not in ours and "failed" not in restart, (ours, restart)
        # the survivors' weights are those of the run without the fault (a restart claims
        # nothing: its difference is reported, not judged)
        assert ours["weights_equal"] is True and ours["weights_max_diff"] < 1e-5, ours
        assert "weights_equal" not in restart and restart["weights_max_diff"] >= 0, restart
        if name == "local_sgd":  # the lost replica's steps since the averaging, replayed
            assert 1 <= ours["steps_lost"] <= 4, ours  # (period 4)
            assert restart["steps_lost"] >= since_checkpoint, restart  # (rank 0 ran ahead)
        else:
            assert ours["steps_lost"] == 0 and restart["steps_lost"] == since_checkpoint, rows
        lost_rank = ours["lost"] == "rank"  # (a lost server's shard moves without a regroup)
        assert ("detect_s" in ours and "regroup_s" in ours) == lost_rank, ours
        assert not lost_rank or (ours["detect_s"] > 0 and ours["regroup_s"] > 0), ours
        assert "detect_s" not in restart, restart
        for row in (ours, restart):
            assert row["world"] == 2 and row["step_s"] > 0, row
            assert row["before_steps_per_s"] > 0 and row["after_steps_per_s"] > 0, row
        assert restart["lost_s"] > ours["lost_s"], (ours, restart)  # (a new interpreter)
    assert [(r["strategy"], r["lost"], r["world"]) for r in ratios] == [
        (case.strategy, case.lost, 2) for case in CASES
    ]  # fmt: skip
    for ratio, ours, restart in zip(ratios, rows[::2], rows[1::2]):
        expected = restart["lost_s"] / max(ours["lost_s"], ours["step_s"])  # (a floor: 1 step)
        assert ratio["restart_over_fault_tolerant"] == expected
        assert ratio["at_least"] == (ours["lost_s"] < ours["step_s"])
    left = [p.name for p in tmp_path.iterdir() if not p.name.startswith("torchinductor")]
    assert left == [], "left behind"


def test_bench_faults_under_torchrun_losing_rank_0(tmp_path, monkeypatch, capsys):
    """``--launch torchrun --lost-rank first``: rank 0 killed under ``torchrun --standalone``,
    the first survivor taking over; the survivors alone are measured (no restart row)."""
    monkeypatch.setenv("LIGHTNING_PAR_BENCH_SYNTHETIC", "1")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    args = ["--strategies", "ring_allreduce", "--worlds", "3", "--steps", "12", "--fault-step",
            str(FAULT), "--width", "4", "--num-blocks", "1", "--batch-size", "8",
            "--launch", "torchrun", "--lost-rank", "first", "--json"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    result = json.loads(out[out.index("{") :])
    assert (result["launch"], result["lost_rank"], result["ratios"]) == ("torchrun", "first", [])
    (row,) = result["rows"]
    assert (row["strategy"], row["approach"], row["world"]) == (
        "ring_allreduce", "fault_tolerant", 3,
    ), row  # fmt: skip
    assert row["weights_equal"] is True and row["steps_lost"] == 0, row
    assert row["detect_s"] > 0 and row["regroup_s"] > 0 and row["after_steps_per_s"] > 0, row
    # (torchrun's agent keeps its log folder: torch's own, by design)
    left = [
        p.name
        for p in tmp_path.iterdir()
        if not p.name.startswith(("torchinductor", "torchelastic_"))
    ]
    assert left == [], "left behind"


def test_bench_faults_names_the_strategies_it_covers_for_one_it_does_not(capsys):
    assert [case.strategy for case in cases_for(["local_sgd"])] == ["local_sgd"]
    with pytest.raises(SystemExit):
        main(["--strategies", "ring_allreduce,gpipe"])
    said = capsys.readouterr().err
    assert "covers ring_allreduce, local_sgd, parameter_server; no case for gpipe" in said


def test_a_fit_that_fails_is_a_row_saying_so_and_the_cases_after_it_still_run(
    tmp_path, monkeypatch
):
    """Without processes: the first script's reference fit raises and its fault-tolerant fit
    runs past the time limit; the restart it never reached says so, and the next case runs
    in a script of its own."""
    scripts: list[list[str]] = []

    def script(cmd: list[str], timeout: float, **kwargs: object) -> Completed:
        cases, approaches = cmd[-2].split(","), cmd[-1].split(",")
        scripts.append(cases)
        if len(scripts) == 1:  # (the first case: its reference fails, its next fit hangs)
            said = (f"FIT {cases[0]} reference\nRAISED ValueError: no such option\n"
                    f"FIT {cases[0]} fault_tolerant\nstep 1\n")  # fmt: skip
            return Completed(-9, "", said, timed_out=True)
        said = "".join(f"FIT {cases[0]} {a}\nRAISED RuntimeError: lost\n" for a in approaches)
        return Completed(0, "", said, timed_out=False)

    monkeypatch.setattr(_faults_fits, "run_bounded", script)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cases = cases_for(["ring_allreduce", "local_sgd"])
    rows = bench(cases, [2], Plan(steps=12, fault=5, every=3))["rows"]
    # the first script for both, the second for the case it never reached, then its resume
    both, second = ["ring_allreduce:rank", "local_sgd:rank"], ["local_sgd:rank"]
    assert scripts == [both, second, second]
    failed = [(r["strategy"], r["approach"], r["failed"]) for r in rows]
    ran_past = f"the script ran past {LIMIT_S:.0f} s"
    assert failed == [
        ("ring_allreduce", "reference", "ValueError: no such option"),
        ("ring_allreduce", "fault_tolerant", ran_past),
        ("ring_allreduce", "restart", "the script ended before this fit"),
        ("local_sgd", "reference", "RuntimeError: lost"),
        ("local_sgd", "fault_tolerant", "RuntimeError: lost"),
        ("local_sgd", "restart", "RuntimeError: lost"),  # (its resume: the script again)
    ], failed


def test_a_replacements_join_is_read_from_the_fits_events_apart_from_the_recovery(tmp_path):
    """``--replace``: when the replacement joined (from the fault) and the pace after it;
    the time lost still ends at the survivors' regroup, not at the join."""
    steps = [{"step": s, "t": 10.0 + s} for s in range(1, 6)]  # 1 step/s before the fault
    steps += [{"step": s, "t": 15.5 + (s - 5) * 0.5} for s in range(6, 12)]  # 2 ranks: 2/s
    steps += [{"step": s, "t": 18.6 + (s - 12) * 0.25} for s in range(12, 18)]  # joined: 4/s
    events = [{"event": "lost", "t": 15.1}, {"event": "regrouped", "t": 15.2},
              {"event": "joined", "t": 18.4}]  # fmt: skip
    rows = "\n".join(json.dumps(row) for row in [*steps, *events])
    (tmp_path / "steps.jsonl").write_text(rows + "\n")
    torch.save({"w": torch.zeros(2)}, tmp_path / "weights.pt")
    plan = Plan(17, 5, 3, launch="torchrun", replace=True)
    row = measure(CASES[0], 3, "fault_tolerant", plan, tmp_path, "", {"w": torch.zeros(2)})
    assert row["joined_s"] == pytest.approx(18.4 - 15.0)  # (step 4 done at 14.0: the fault)
    assert row["whole_steps_per_s"] == pytest.approx(4.0)
    assert row["after_steps_per_s"] == pytest.approx(2.0)  # (from the regroup to the join)
    assert row["lost_s"] == pytest.approx(16.0 - 15.0 - 1.0, abs=0.01)  # (step 6 at 16.0)
    assert "replacement joined 3.4 s after the fault; 4.00 steps/s" in report(
        {"rows": [row], "ratios": [], "model": {"width": 1, "num_blocks": 1, "batch_size": 1},
         "fault_step": 5}
    )  # fmt: skip
