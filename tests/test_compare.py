"""``python -m lightning_par.compare``: the step split, the byte models, the report."""

import json
import math

import pytest
import torch

from lightning_par.comm.trace import CommTrace, Event, Message
from lightning_par.compare import __main__ as cli
from lightning_par.compare.costs import (
    allreduce_bytes,
    hybrid_bytes,
    predicted_bytes,
    tensor_parallel_bytes,
)
from lightning_par.hybrid.cost import hybrid_bytes_per_step
from lightning_par.hybrid.grid import Grid
from lightning_par.measure.breakdown import (
    intersect,
    measure,
    split_rank,
    split_steps,
    subtract,
    union,
)
from lightning_par.measure.run import make_model
from lightning_par.strategies.registry import parse_choice
from lightning_par.tensorparallel import resolve_plan
from lightning_par.tensorparallel.cost import step_cost


def test_interval_arithmetic():
    assert union([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    assert intersect([(0, 2), (3, 5)], [(1, 4)]) == [(1, 2), (3, 4)]
    assert subtract([(0, 5)], [(1, 2), (3, 4)]) == [(0, 1), (2, 3), (4, 5)]
    assert measure([(0, 1), (2, 4)]) == 3


def _pair(send_posted: float) -> dict[int, CommTrace]:
    """Rank 1 computes 0..0.1, then waits from 0.1 for a message rank 0 posts at
    ``send_posted``; it arrives at 0.5. Both clocks start at 100 s."""
    sender, receiver = CommTrace(0, origin=100.0), CommTrace(1, origin=100.0)
    sender.messages.append(Message(0, "send", 1, 64, send_posted, 0.5, wait_start=send_posted))
    receiver.messages.append(Message(1, "recv", 0, 64, 0.0, 0.5, wait_start=0.1))
    receiver.events.append(Event(1, "fwd", 0.0, 0.1))
    return {0: sender, 1: receiver}


def test_a_receive_splits_into_waiting_for_the_peer_and_communication():
    traces = _pair(send_posted=0.4)
    parts = split_steps(traces, {1: [(100.0, 101.0)]})[1]
    assert parts["waiting"] == pytest.approx(0.3)  # 0.1 .. 0.4: the peer had not sent
    assert parts["communication"] == pytest.approx(0.1)  # 0.4 .. 0.5: the message moved
    assert parts["compute"] == pytest.approx(0.6)
    assert sum(parts[k] for k in ("compute", "communication", "waiting")) == pytest.approx(1.0)
    early = split_steps(_pair(send_posted=0.0), {1: [(100.0, 101.0)]})[1]
    assert early["waiting"] == 0 and early["communication"] == pytest.approx(0.4)


def test_communication_behind_compute_is_overlapped_not_part_of_the_step():
    trace = CommTrace(0, origin=0.0)
    trace.events.append(Event(0, "backward", 0.0, 0.4))  # the main thread computes
    trace.messages.append(Message(0, "send", 1, 8, 0.1, 0.6, wait_start=0.1))  # comm thread
    parts = split_rank(trace, [(0.0, 1.0)], {})
    assert parts["overlapped"] == pytest.approx(0.3)
    assert parts["communication"] == pytest.approx(0.2)
    assert parts["compute"] == pytest.approx(0.8)


def test_strategy_hints_and_models_degrade_for_unknown_names():
    class Plain: ...

    class Wide:
        compare_devices = 3

        @staticmethod
        def compare_bytes_per_step(model, devices, batch, options):
            return [7] * devices

    assert cli.devices_for("tensor_parallel", Plain, 2) == 2
    assert cli.devices_for("hybrid", Plain, 2) == 4
    assert cli.devices_for("anything", Wide, 2) == 3
    model = make_model("CifarCNN")
    assert predicted_bytes("new_one", {}, Plain, model, 2, 64) == (
        None, "no cost model for this strategy in the compare")  # fmt: skip
    assert predicted_bytes("new_one", {}, Wide, model, 2, 64)[0] == [7, 7]
    n = sum(p.numel() for p in model.parameters())
    params = len(list(model.parameters()))
    # one bucket of gradients and flags; the ring sends 2(p-1)/p of it per rank
    assert allreduce_bytes(model, "ring", 2) == [(n + params) * 4] * 2


class Features(torch.nn.Module):
    """A network of 20 features in (not CIFAR images), which says so by its example input."""

    def __init__(self) -> None:
        super().__init__()
        layers = [torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)]
        self.net = torch.nn.Sequential(*layers, torch.nn.ReLU(), torch.nn.Linear(8, 4))
        self.example_input_array = torch.zeros(2, 20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_split_models_read_the_input_shape_from_the_example_input():
    model = Features()
    batch = torch.zeros(8, 20)
    plan = resolve_plan(model, 2, None, "net", (batch[:2],))
    assert tensor_parallel_bytes(model, 2, 8, {}) == list(step_cost(model, plan, batch).bytes_sent)
    assert hybrid_bytes(model, 4, 8, {"mp": 2}) == hybrid_bytes_per_step(
        model.net, Grid(2, 2), 8, sample_shape=(20,)
    )
    with pytest.raises(ValueError, match="no byte model"):
        hybrid_bytes(model, 4, 8, {"mp": 2, "mp_kind": "tensor_parallel"})


@pytest.mark.parametrize(
    "argv, words",
    [(["--strategies", "nope"], "unknown strategies"),
     (["--strategies", "zero:stage=4"], "zero:stage=4: zero: stage must be 1"),
     (["--strategies", "zero:stage"], "write NAME:KEY=VALUE"),
     (["--strategies", "zero:stages=2"], "ZeroStrategy got unknown option(s) ['stages']"),
     (["--batch-size", "63"], "must split evenly"),
     (["--steps", "3", "--warmup", "4"], "must be larger")],
)  # fmt: skip
def test_bad_options_fail_before_any_process_starts(argv, words, capsys):
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert words in capsys.readouterr().err


def test_report_of_three_strategies(tmp_path, capsys):
    names = ["ring_allreduce", "gpipe", "lightning_ddp"]
    out = tmp_path / "report"
    argv = ["--strategies", *names, "--steps", "6", "--warmup", "2", "--rounds", "1",
            "--data", "synthetic", "--out", str(out), "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["strategy"]: r for r in doc["rows"]}
    assert list(rows) == names and all(r["status"] == "ok" for r in rows.values())
    assert {"cpu", "cores", "torch", "lightning", "python"} <= set(doc["machine"])
    for r in rows.values():
        assert {"workers", "processes", "images_per_s", "final_loss", "state_bytes_max"} <= set(r)
        assert r["images_per_s"] * r["step_s"] == pytest.approx(64)
        assert r["steps_timed"] == 4
        for key, value in r.items():
            if key.endswith("_s") and value is not None:  # seconds, one or one per round
                values = value if isinstance(value, list) else [value]
                assert all(isinstance(v, float) and v >= 0 for v in values), key
    for name in ("ring_allreduce", "gpipe"):  # traced: measured bytes are the model's
        r = rows[name]
        assert r["bytes_sent_per_step_per_rank"] == r["model_bytes_per_step_per_rank"]
        split = r["compute_s"] + r["communication_s"] + r["waiting_s"]
        assert split == pytest.approx(r["step_s"], rel=1e-6)
        assert r["communication_s"] > 0
    assert rows["gpipe"]["per_rank_batch"] == 64 and rows["ring_allreduce"]["per_rank_batch"] == 32
    ddp = rows["lightning_ddp"]
    assert not ddp["traced"] and ddp["communication_s"] is None and ddp["vs_ddp"] == 1.0
    # the same samples per step: the synchronous strategies compute one process's updates
    losses = [r["final_loss"] for r in rows.values()]
    assert max(losses) - min(losses) < 1e-3 and all(math.isfinite(v) for v in losses)
    page = (out / "report.md").read_text()
    assert all(f"| {name} |" in page for name in names)
    assert "no model" in page and "untraced" in page
    for picture in ("step_split.png", "throughput_bytes_memory.png", "loss.png"):
        assert (out / picture).read_bytes()[:4] == b"\x89PNG"
        assert f"]({picture})" in page


def test_a_strategy_with_options_is_a_row_of_its_own():
    assert parse_choice("zero") == ("zero", {})
    assert parse_choice("zero:stage=1,bucket_cap_mb=0.5,trace_dir=x") == (
        "zero", {"stage": 1, "bucket_cap_mb": 0.5, "trace_dir": "x"})  # fmt: skip
    assert cli.folder_name("zero:stage=1") == "zero-stage=1"


def test_zero_stages_send_what_their_cost_model_says_and_hold_their_shards(tmp_path, capsys):
    """Stage 1: the ring's buckets and an all-gather; 2: a reduce-scatter and an all-gather;
    3: two all-gathers and a reduce-scatter, counted in the traces. At the end of training a
    stage-3 rank holds half the parameters, half their gradients and half the momentum (2
    ranks); stages 1-2 hold every parameter (stage 2: a shard of the gradients, stage 1 the
    slices its pieces step of the whole gradients it had)."""
    names = ["zero:stage=1", "zero:stage=2", "zero"]
    argv = ["--strategies", *names, "--steps", "5", "--warmup", "2", "--rounds", "1",
            "--data", "synthetic", "--out", str(tmp_path), "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert list(rows) == names and rows["zero"]["options"] == {}
    for r in rows.values():
        assert r["bytes_sent_per_step_per_rank"] == r["model_bytes_per_step_per_rank"], r
    params = sum(p.numel() * 4 for p in make_model("CifarCNN").parameters())
    sent = {n: r["model_bytes_per_step"] for n, r in rows.items()}
    assert sent["zero:stage=2"] == pytest.approx(params, rel=0.01)  # 2 (p-1)/p
    assert sent["zero"] == pytest.approx(1.5 * params, rel=0.01)  # 3 (p-1)/p
    state = {n: r["state_bytes_max"] for n, r in rows.items()}
    assert state["zero"] == pytest.approx(3 * params / 2, rel=0.01)  # SGD with momentum
    assert state["zero:stage=2"] == pytest.approx(params + params, rel=0.01)
    page = (tmp_path / "report.md").read_text()
    assert "| zero:stage=1 |" in page and "MB/rank" in page  # the simulator's formulas


def test_load_warning_counts_other_jobs_not_the_comparisons_own_workers():
    from lightning_par.compare.report import _load_warning

    machine = {"cores": 2, "load_1m_start": 0.6, "load_1m_end": 2.9}
    assert _load_warning(machine, own=2) == []  # its own 2 workers kept 2 cores busy
    assert "oversubscribed (load 2.9 on 2 cores" in _load_warning(machine, own=0)[0]
    assert _load_warning({**machine, "load_1m_start": 3.5}, own=2)  # busy before it began
