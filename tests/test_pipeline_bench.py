"""``python -m lightning_par.bench pipeline`` measures what it says: each of our schedules
sends one activation and one gradient message per micro-batch and cut, carrying exactly the
batch's activations at the cut, torch's schedules run as the peers of ours, and the theory
column is each schedule's bubble formula."""

import json

import pytest
import torch

from lightning_par.bench.pipeline import linear_workload, main, report, run
from lightning_par.pipeline import balance_by_params


def test_pipeline_bench_counts_the_schedules_messages(capsys):
    argv = ["--workload", "linear", "--chunks", "2,4", "--steps", "1", "--rounds", "1"]
    # one thread only: earlier tests started OpenMP threads in this process, which a forked
    # child cannot use
    assert main(argv + ["--warmup", "1", "--single-threads", "1", "--json",
                        "--keep-freed-memory"]) == 0  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert doc["environment"]["torch"] == torch.__version__
    (result,) = doc["workloads"]
    rows = {(row["name"], row["chunks"]): row for row in result["rows"]}
    assert list(rows) == [
        ("naive", 1), ("gpipe", 2), ("gpipe", 4), ("1f1b", 2), ("1f1b", 4),
        ("interleaved", 2), ("interleaved", 4), ("zero_bubble", 2), ("zero_bubble", 4),
        ("zbv", 2), ("zbv", 4), ("torch ScheduleGPipe", 2), ("torch ScheduleGPipe", 4),
        ("torch Schedule1F1B", 2), ("torch Schedule1F1B", 4),
        ("torch ScheduleInterleaved1F1B", 2), ("torch ScheduleInterleaved1F1B", 4),
        ("torch ScheduleInterleavedZeroBubble", 2), ("torch ScheduleInterleavedZeroBubble", 4),
        ("torch ScheduleZBVZeroBubble", 2), ("torch ScheduleZBVZeroBubble", 4),
    ]  # fmt: skip
    # the Linear stack is cut between two Linear(1024) layers: a 256 x 1024 float batch
    cut_bytes = 256 * 1024 * 4
    peers = {"gpipe": "torch ScheduleGPipe", "1f1b": "torch Schedule1F1B",
             "interleaved": "torch ScheduleInterleaved1F1B",
             "zero_bubble": "torch ScheduleInterleavedZeroBubble",
             "zbv": "torch ScheduleZBVZeroBubble"}  # fmt: skip
    for (name, m), row in rows.items():
        kind = {v: k for k, v in peers.items()}.get(name, name)
        expected = {"interleaved": 1 / (2 * m + 1), "zero_bubble": 1 / (3 * m + 1),
                    "zbv": 1 / (6 * m + 1)}  # fmt: skip
        assert row["theory_bubble"] == expected.get(kind, 1 / (m + 1)), (name, m)
        assert len(row["stage_cpu_ms"]) == 2
        cpu = row["stage_cpu_ms"]
        assert row["imbalance_floor"] == pytest.approx(1 - (cpu[0] + cpu[1]) / (2 * max(cpu)))
        if name.startswith("torch"):
            assert "messages_per_step" not in row
            continue
        # each device sends one activation or gradient per micro-batch and cut it sits at,
        # every timed step (shape headers went once, in the first warm-up step): GPipe's
        # one cut carries the whole batch each way; interleaving (v = 2, 3 cuts) thrice;
        # ZBV's V (stages 0, 3 | 1, 2) twice: its middle cut stays on device 1
        cuts = {"interleaved": 3, "zbv": 2}.get(name, 1)
        assert row["messages_per_step"] == [cuts * m, cuts * m], (name, m)
        assert row["bytes_per_step"] == [cuts * cut_bytes] * 2, (name, m)
        assert all(b > 0 for b in row["peak_saved_bytes"])
        # the schedule replayed with its measured step costs and free messages can only be
        # faster than the run: its bubble is at most the measured one
        assert 0 <= row["theory_bubble_measured_costs"] <= row["measured_bubble"] + 1e-9
        split = {"bwd_input", "bwd_weight"} if name in ("zero_bubble", "zbv") else {"bwd"}
        # the gap to the formula is the replay's (costs) plus the run's own (runtime)
        assert row["bubble_gap_costs"] + row["bubble_gap_runtime"] == pytest.approx(
            row["measured_bubble"] - row["theory_bubble"]
        )
        assert set(row["mean_step_ms"]) == {"fwd"} | split, name
        peer = rows.get((peers.get(name), m))
        if peer is not None:
            assert row["speedup_vs_torch_peer"] == peer["step_ms"] / row["step_ms"]
    # each layout's cut, shared by ours and torch's rows of that layout
    net = linear_workload()[0]
    assert result["balances"] == {
        "pipeline": {str(m): balance_by_params(net, 2) for m in (1, 2, 4)},
        "interleaved": {str(m): balance_by_params(net, 4) for m in (2, 4)},
        "zbv": {str(m): balance_by_params(net, 4) for m in (1, 2, 4)},
    }
    assert rows[("zbv", 2)]["balance"] == rows[("torch ScheduleZBVZeroBubble", 2)]["balance"]
    assert rows[("gpipe", 2)]["balance"] == result["balance"] == [7, 9]
    # the goals: our fastest row over torch's fastest ScheduleGPipe row and fastest row
    goals, ours = result["goals"], [r for r in rows.values() if not r["name"].startswith("t")]
    best = min(r["step_ms"] for r in ours if r["name"] != "naive")
    gpipe = min(rows[("torch ScheduleGPipe", m)]["step_ms"] for m in (2, 4))
    assert goals["best_vs_torch_gpipe"] == pytest.approx(gpipe / best)
    bound = min(max(r["stage_cpu_ms"]) for r in ours if r["name"] != "naive")
    assert goals["cpu_bound_ms"][2] == bound
    assert result["keep_freed_memory"] is True
    saved = result["saved_activation_bytes_per_stage"]
    assert all(a < n for a, n in zip(saved["always"], saved["never"]))


def test_a_torch_schedule_that_fails_is_a_row_and_ours_are_measured():
    # a schedule this torch lacks (as torch 2.4 lacks ScheduleZBVZeroBubble) fails on every
    # rank when it is built; torch's GPipe and all of ours still run
    result = run("linear", [2], warmup=0, steps=1, rounds=1, single_threads=(1,),
                 peers=("ScheduleGPipe", "ScheduleNoSuch"))  # fmt: skip
    rows = {row["name"]: row for row in result["rows"]}
    assert list(rows) == ["naive", "gpipe", "1f1b", "interleaved", "zero_bubble", "zbv",
                          "torch ScheduleGPipe", "torch ScheduleNoSuch"]  # fmt: skip
    failed = rows["torch ScheduleNoSuch"]
    assert set(failed) == {"name", "failed"}
    assert failed["failed"].startswith("rank 0: ValueError: unknown schedule 'ScheduleNoSuch'")
    assert all(row["step_ms"] > 0 for name, row in rows.items() if name != failed["name"])
    assert rows["gpipe"]["speedup_vs_torch_peer"] > 0
    assert result["goals"]["best_vs_torch_gpipe"] > 0
    table = report(result)
    assert "| torch ScheduleNoSuch | failed: rank 0: ValueError: unknown schedule" in table


_FAULTS = """
import ctypes, resource, sys, torch
from lightning_par.bench.malloc import keep_freed_memory
# glibc's own start: blocks over 128 KiB are mapped per allocation and unmapped when freed
# (fixed here: glibc raises the threshold by itself after some frees, unpredictably)
ctypes.CDLL(None).mallopt(-3, 128 * 1024)
if sys.argv[1] == "keep":
    assert keep_freed_memory()
for _ in range(3):  # a step's activations: six 8 MiB blocks, all freed at its end
    [torch.ones(2**21) for _ in range(6)]
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    [torch.ones(2**21) for _ in range(6)]
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_keeping_freed_memory_removes_the_page_faults_of_reallocating():
    import subprocess
    import sys

    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True,
                             text=True, check=True, timeout=120)  # fmt: skip
        return int(out.stdout.split()[-1])

    # each "step" maps six 8 MiB blocks afresh: about 12,000 pages faulted in
    assert faults("default") > 20 * 6 * 1000
    assert faults("keep") < 1000
