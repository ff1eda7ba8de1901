"""The schedule registry (``lightning_par.pipeline.schedules``): one object per schedule, a
name looked up once with an error listing the known ones, each schedule's rules, and no
other module comparing schedule names."""

from __future__ import annotations

import ast
import pathlib
import pickle

import pytest

import lightning_par
from lightning_par.components.pipeline_options import PipelineOptions
from lightning_par.pipeline import schedules
from lightning_par.pipeline.schedules import (
    GPIPE,
    INTERLEAVED,
    ONE_F_ONE_B,
    SCHEDULES,
    ZBV,
    ZERO_BUBBLE,
    Schedule,
    get_schedule,
)
from lightning_par.pipeline.step import checked_schedule
from lightning_par.strategies.gpipe import GPipeStrategy
from lightning_par.strategies.hybrid import HybridStrategy

NAMES = ("gpipe", "1f1b", "interleaved", "zero_bubble", "zbv")


def test_one_object_per_name():
    assert tuple(SCHEDULES) == NAMES
    assert [s.name for s in SCHEDULES.values()] == list(NAMES)
    assert list(SCHEDULES.values()) == [GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE, ZBV]
    for name, schedule in SCHEDULES.items():
        assert get_schedule(name) is schedule
        assert get_schedule(schedule) is schedule  # an object passes through
        # a spawned rank unpickles the registry's own object
        assert pickle.loads(pickle.dumps(schedule)) is schedule
        assert eval(repr(schedule), {"get_schedule": get_schedule}) is schedule


@pytest.mark.parametrize("name", ["zb", "1F1B", "", None, 3])
def test_an_unknown_name_lists_the_known_ones(name):
    known = "('gpipe', '1f1b', 'interleaved', 'zero_bubble', 'zbv')"
    with pytest.raises(ValueError) as refused:
        get_schedule(name)
    assert str(refused.value) == f"unknown schedule {name!r}: choose one of {known}"


def test_the_strategies_list_what_they_run_and_refuse_the_v_with_its_fix():
    for make in (GPipeStrategy, HybridStrategy):
        with pytest.raises(ValueError) as refused:
            make(schedule="zigzag")
        assert str(refused.value) == (
            "schedule='zigzag': choose one of ('gpipe', '1f1b', 'interleaved', 'zero_bubble')"
        )
    with pytest.raises(ValueError, match="GPipeStrategy does not run schedule='zbv'.*zero_bubble"):
        PipelineOptions(schedule=ZBV)  # an object is checked as a name is


@pytest.mark.parametrize(
    "schedule, loss_per_micro_batch, split_backward, checkpoint, per_device, v_shape",
    [
        (GPIPE, False, False, "except_last", 1, False),
        (ONE_F_ONE_B, True, False, "except_last", 1, False),
        (INTERLEAVED, True, False, "except_last", 3, False),
        (ZERO_BUBBLE, True, True, "never", 1, False),
        (ZBV, True, True, "never", 2, True),
    ],
    ids=NAMES,
)
def test_what_each_schedule_knows(
    schedule, loss_per_micro_batch, split_backward, checkpoint, per_device, v_shape
):
    assert schedule.loss_per_micro_batch is loss_per_micro_batch
    assert schedule.sends_both_ways is loss_per_micro_batch  # NCCL refuses these
    assert schedule.split_backward is split_backward
    assert schedule.default_checkpoint == checkpoint
    assert schedule.stages_per_device(3) == per_device
    assert schedule.v_shape is v_shape
    where = schedule.placement(3)
    stages = [where(s) for s in range(3 * per_device)]
    assert stages == ([0, 1, 2, 2, 1, 0] if v_shape else [s % 3 for s in range(3 * per_device)])
    # the step lists hold every stage's forward and backward of every micro-batch, each on the
    # device the placement says
    v = 2 if v_shape else (3 if schedule.takes_virtual_stages else 1)
    steps = schedule.steps(3, 6, v)
    assert len(steps) == 3
    ops = {"fwd", "bwd_input", "bwd_weight"} if split_backward else {"fwd", "bwd"}
    for device, lst in enumerate(steps):
        assert {s.op for s in lst} == ops
        assert {where(s.stage) for s in lst} == {device}
    assert len({(s.op, s.stage, s.micro_batch) for lst in steps for s in lst}) == (
        len(ops) * 3 * schedule.stages_per_device(v) * 6
    )
    # split backwards refuse re-materialisation; whole ones take any mode
    for mode in ("never", "except_last", "always"):
        if split_backward and mode != "never":
            with pytest.raises(ValueError, match=f"gpipe: schedule={schedule.name!r} refuses"):
                schedule.check_checkpoint(mode, "gpipe")
        else:
            schedule.check_checkpoint(mode, "gpipe")


@pytest.mark.parametrize("schedule", SCHEDULES.values(), ids=NAMES)
def test_each_chunk_rule_refuses_what_it_should(schedule):
    for devices in (1, 2, 3, 4):
        for chunks in range(1, 10):
            if schedule is INTERLEAVED and chunks % devices:
                up = chunks + devices - chunks % devices
                down = max(devices, chunks - chunks % devices)
                fix = f"multiple of the {devices} devices.*use chunks={up} or {down}"
                with pytest.raises(ValueError, match=f"^gpipe: schedule='interleaved'.*{fix}"):
                    schedule.check_chunks(chunks, devices, "gpipe")
                # the step lists keep the same rule (with several stages per device)
                with pytest.raises(ValueError, match=f"^schedule='interleaved'.*{fix}"):
                    schedule.steps(devices, chunks, 2)
            else:
                schedule.check_chunks(chunks, devices, "gpipe")


def test_each_schedule_refuses_stages_per_device_it_does_not_hold():
    with pytest.raises(ValueError, match="ZB-H1, one stage per device: use virtual_stages=1"):
        ZERO_BUBBLE.steps(2, 4, 2)
    with pytest.raises(ValueError, match="two stages per device.*virtual_stages=2, not 1"):
        ZBV.steps(2, 4, 1)


def test_the_strategy_looks_the_name_up_once_and_holds_the_object(monkeypatch):
    split = GPipeStrategy(schedule="interleaved", chunks=4).splitter
    assert split.schedule is INTERLEAVED and split.options.schedule is INTERLEAVED
    assert split.checkpoint == "except_last"
    assert GPipeStrategy(schedule="zero_bubble").splitter.checkpoint == "never"
    # from here on nothing looks a name up: with the registry gone, the split's schedule
    # still answers, its steps are checked and its options build again
    monkeypatch.setattr(schedules, "SCHEDULES", {})
    assert split.stages_per_device == 2
    assert len(checked_schedule(split.schedule, 2, split.chunks, split.stages_per_device)) == 2
    split.schedule.check_chunks(split.chunks, 2, "gpipe")
    assert PipelineOptions(schedule=split.schedule).schedule is INTERLEAVED
    with pytest.raises(ValueError, match="choose one of"):
        PipelineOptions(schedule="interleaved")  # a name now would have to be looked up


# ---- a schedule's name is compared in one place ------------------------------------------
def _name_comparisons(path: pathlib.Path) -> list[str]:
    """``x == "1f1b"``, ``x != "zbv"``, ``x in ("interleaved", ...)``: a schedule name against
    a value (``"gpipe"`` only against something called schedule: it names a strategy too)."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        parts = [node.left, *node.comparators]
        texts = {ast.unparse(p) for p in parts}
        for part in parts:
            consts = list(part.elts) if isinstance(part, (ast.Tuple, ast.List, ast.Set)) else [part]
            names = {c.value for c in consts if isinstance(c, ast.Constant)} & set(NAMES)
            if names - {"gpipe"} or (names and any("schedule" in t for t in texts)):
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_but_the_registry_compares_schedule_names():
    package = pathlib.Path(lightning_par.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        found += _name_comparisons(path)
    assert not found, "ask the Schedule object instead:\n" + "\n".join(found)


def test_the_name_check_sees_a_comparison(tmp_path):
    code = tmp_path / "mod.py"
    code.write_text('def f(schedule, k):\n    return schedule != "gpipe" or k in ("zbv", 1)\n')
    assert len(_name_comparisons(code)) == 2
    code.write_text('def f(kind):\n    return kind in ("gpipe", "layerwise")\n')  # strategies
    assert _name_comparisons(code) == []


def test_schedule_is_the_base_of_every_registered_schedule():
    assert all(isinstance(s, Schedule) for s in SCHEDULES.values())
    with pytest.raises(TypeError):
        Schedule()  # abstract: a schedule says its steps
