"""A real small run replayed: compare keeps its traces, the simulator reproduces its steps,
and the report's predicted section and the CLI work on them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_par.compare import __main__ as compare_cli
from lightning_par.simulate import __main__ as cli
from lightning_par.simulate.links import Topology
from lightning_par.simulate.profile import profile
from lightning_par.simulate.replay import load_run, replay
from lightning_par.simulate.validate import VALIDATED, own_link, pooled_loopback

STRATEGIES = ["ring_allreduce", "gpipe", "tensor_parallel"]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("compare") / "report"
    argv = ["--strategies", *STRATEGIES, "--steps", "6", "--warmup", "2", "--rounds", "1",
            "--data", "synthetic", "--out", str(out)]  # fmt: skip
    assert compare_cli.main(argv) == 0
    return out


def test_replay_on_the_fitted_loopback_reproduces_each_measured_step(report):
    runs = [load_run(report / "runs" / name) for name in STRATEGIES]
    pooled = pooled_loopback(runs)
    for run in runs:
        assert run.windows and all(len(w) == 4 for w in run.windows.values())
        link = own_link(run, pooled)
        result = replay(run, Topology(link, link), link=link)
        # (within 5 % in the quiet validations of benchmarks/simulate.md; beside the rest of
        # CI on 2 cores the steps' untraced gaps grow: gpipe's replay was 10.5 % off once)
        assert result.mean_step_s == pytest.approx(run.measured_step_s, rel=0.15), run.name
        split = result.per_step_split(0)
        assert sum(split.values()) == pytest.approx(result.step_s(0), rel=1e-6)


def test_tensor_parallel_traces_its_model_apart_from_the_steps_overhead(report):
    run = load_run(report / "runs" / "tensor_parallel")
    for trace in run.traces:
        names = {e.name for e in trace.events}
        assert {"tp forward", "tp backward"} <= names, trace.rank
    prof = profile(run)
    # forward and backward without their collectives: a part of the step's compute, not all
    assert prof.model == "CifarCNN"
    assert 0 < prof.model_s < prof.compute_s


def test_a_pipelines_profile_holds_each_stages_forward_and_backward(report):
    run = load_run(report / "runs" / "gpipe")
    prof = profile(run)
    # one figure per stage, in rank order, summing to the whole model's per micro-batch
    assert len(prof.stage_s) == prof.world and min(prof.stage_s) > 0
    assert sum(prof.stage_s) == pytest.approx(prof.fwd_s + prof.bwd_s)


def test_a_faster_network_and_device_shorten_the_replayed_step(report):
    run = load_run(report / "runs" / "gpipe")
    link = run.loopback()
    here = replay(run, Topology(link, link), link=link).mean_step_s
    fast = cli.main(["--replay", str(report / "runs" / "gpipe"), "--link", "nvlink",
                     "--speedup", "100", "--out", str(report / "sim"), "--json"])  # fmt: skip
    assert fast == 0
    assert (report / "sim" / "gpipe_gantt.png").read_bytes()[:4] == b"\x89PNG"
    assert here > 0


def test_scale_table_and_the_reports_predicted_section(report, capsys):
    page = (report / "report.md").read_text()
    assert "## Predicted at scale (simulated, not measured)" in page
    assert "nvlink+ib" in page and "(predicted_scaling.png)" in page
    assert (report / "predicted_scaling.png").read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    assert cli.main(["--from", str(report), "--devices", "8,64", "--link", "pcie",
                     "--out", str(report / "sim"), "--json"]) == 0  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    rows = {(r["strategy"], r["devices"]): r for r in doc["rows"]}
    assert set(rows) == {(s, p) for s in STRATEGIES for p in (8, 64)}
    assert rows[("gpipe", 8)]["step_s"] is None  # CifarCNN has 4 layers to split
    assert "no layer the automatic plan cuts 8 ways" in rows[("tensor_parallel", 8)]["note"]
    assert 0 < rows[("ring_allreduce", 64)]["efficiency"] <= 1.0


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--from", "nowhere"], "nowhere is not a folder"),
        (["--validate", "--reuse", "nowhere"], "nowhere is not a folder"),
        (["--replay", ".", "--link", "nvlnk"], "unknown link preset 'nvlnk'"),
        (["--replay", ".", "--devices", "8,x"], "give counts like 8,64,512"),
        (["--replay", ".", "--rank-speed", "1:2"], "write RANK=FACTOR"),
        (["--replay", ".", "--speedup", "0"], "--speedup must be > 0"),
        (["--validate", "--strategies", "ring_allreduce,zero"], "choose from ring_allreduce,"),
    ],
)
def test_bad_options_fail_before_anything_runs(argv, words, capsys):
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert words in capsys.readouterr().err


def test_a_validation_can_train_a_few_of_the_strategies():
    args = cli.parse(["--validate", "--strategies", "gpipe, ring_allreduce", "--rounds", "1"])
    assert args.strategies == ["gpipe", "ring_allreduce"] and args.rounds == 1
    assert cli.parse(["--validate"]).strategies == list(VALIDATED)


def test_a_folder_without_traces_is_an_error_not_a_traceback(tmp_path, capsys):
    assert cli.main(["--replay", str(tmp_path)]) == 2
    assert "no traces (rank<N>.json)" in capsys.readouterr().err


def test_a_plain_trace_dir_replays_as_one_step(report, tmp_path, capsys):
    # what Trainer(strategy=AllReduceStrategy(algorithm="ring", trace_dir=...)) leaves:
    # rank<N>.json files and nothing else (no probes, no row.json)
    traces = tmp_path / "traces"
    traces.mkdir()
    for f in (report / "runs" / "ring_allreduce" / "trace").glob("rank*.json"):
        (traces / f.name).write_bytes(f.read_bytes())
    capsys.readouterr()
    assert cli.main(["--replay", str(traces), "--link", "nvlink", "--out", str(tmp_path),
                     "--json"]) == 0  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert doc["strategy"] == "traces" and doc["measured_step_s"] is None
    assert set(doc["split"]) == {"0", "1"}  # both ranks, JSON keys
    assert 0 < doc["predicted_step_s"]


def test_validation_table_shows_where_a_scale_row_missed():
    from lightning_par.simulate.report import validation_table

    row = {"strategy": "ring_allreduce", "kind": "scale 2->4", "measured_s": 0.3,
           "predicted_s": 0.2, "error": -1 / 3, "steps_s": [0.3, 0.33, 0.36], "spread": 0.2,
           "other_load": 0.25, "offset_s": 0.005,
           "measured_split": {"compute": 0.25, "communication_and_waiting": 0.05,
                              "cpu": 0.12},
           "predicted_split": {"compute": 0.15, "communication": 0.04, "waiting": 0.01,
                               "core_compute": 0.07, "core_communication": 0.0}}  # fmt: skip
    cells = validation_table([row]).splitlines()[-1].split(" | ")
    assert cells[1:] == [
        "scale 2->4",
        "300.0",
        "3, 20%",  # rounds, and the slowest over the fastest
        "0.25",  # cores' worth of other processes' work beside the fastest
        "200.0",
        "-33.3%",
        "250.0 -> 150.0",  # compute, waits for a core included
        "130.0 -> 70.0",  # of which waiting for a core
        "50.0 -> 55.0 |",  # the rest, the 2-worker offset carried over
    ]
    replay = {"strategy": "ring_allreduce", "kind": "replay", "measured_s": 0.3,
              "predicted_s": 0.3, "error": 0.0, "steps_s": [0.3], "spread": None,
              "other_load": None}  # fmt: skip
    assert validation_table([replay]).splitlines()[-1].split(" | ")[3:5] == ["1", "-"]


def test_a_validation_row_reports_every_round_and_the_load_beside_the_fastest():
    from lightning_par.simulate.replay import Run
    from lightning_par.simulate.validate import _row

    def run(step: float) -> Run:
        return Run("ring", [], {0: [(0.0, step)], 1: [(0.0, step)]})

    row = _row("ring_allreduce", "scale 2->3", [run(0.04), run(0.05), run(0.044)], 0.042)
    assert row["measured_s"] == pytest.approx(0.04)  # the fastest round is the measured
    assert row["error"] == pytest.approx(0.05)
    assert row["steps_s"] == pytest.approx([0.04, 0.05, 0.044])
    assert row["spread"] == pytest.approx(0.25)
    assert row["other_load"] is None  # no CPU clocks in these runs
