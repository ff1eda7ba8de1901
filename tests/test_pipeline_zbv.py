"""ZBV (zero bubble, V-shaped stages): the step lists over the validator's grid, the strategy's
refusal, and the cuts chosen for devices and by replay. ZBV's weights against one process
(the Linear stack and the CIFAR CNN): tests/test_pipeline_schedules.py."""

from __future__ import annotations

import itertools

import pytest

from lightning_par.pipeline.partition import balance_by_replay, balance_for_devices
from lightning_par.pipeline.schedule import max_in_flight
from lightning_par.pipeline.schedules import (
    device_schedule,
    formula_bubble,
    placement,
)
from lightning_par.pipeline.schedules_zbv import v_device_of
from lightning_par.pipeline.validate import ScheduleError, simulated_bubble, validate
from lightning_par.split import balance_by_cost

# K devices, M micro-batches: the ideal bubble is reached whenever M is a multiple of K
GRID = [(k, m) for k, m in itertools.product([1, 2, 3, 4, 8], [1, 2, 3, 4, 6, 8, 12, 16])
        if m % k == 0]  # fmt: skip


@pytest.mark.parametrize("k,m", GRID)
def test_zbv_passes_the_validator_with_its_bubble(k, m):
    steps = device_schedule("zbv", k, m, 2)
    assert [v_device_of(s, k) for s in range(2 * k)] == [*range(k), *reversed(range(k))]
    timed = validate(steps, num_stages=2 * k, chunks=m, device_of=placement("zbv", k))
    bubble = simulated_bubble(timed, k)
    assert bubble == pytest.approx(formula_bubble("zbv", k, m, 2))
    if k > 1:  # about half of ZB-H1's: (K-1)/(6M+K-1) against (K-1)/(3M+K-1)
        assert bubble < formula_bubble("zero_bubble", k, m) * 0.6
    # memory: a device holds at most 2K stage-micro-batches between F and B (1F1B's K
    # whole-model micro-batches)
    for lst in steps:
        assert max_in_flight([s for s in lst if s.op != "bwd_weight"]) <= 2 * k


@pytest.mark.parametrize("k,m", [(2, 3), (3, 4), (4, 6), (2, 1), (4, 5)])
def test_zbv_runs_any_chunks(k, m):  # other M: valid, only the bubble is larger
    timed = validate(device_schedule("zbv", k, m, 2), 2 * k, m, placement("zbv", k))
    assert simulated_bubble(timed, k) >= formula_bubble("zbv", k, m, 2) - 1e-12


def test_zbv_refuses_other_virtual_stages_and_round_robin_placement():
    with pytest.raises(ValueError, match="virtual_stages=2, not 3"):
        device_schedule("zbv", 2, 4, 3)
    with pytest.raises(ScheduleError, match="lives on device"):
        validate(device_schedule("zbv", 2, 4, 2), 4, 4)  # round-robin: stage 2 is not on 0


def test_the_strategy_refuses_zbv_with_the_fix():
    from lightning_par.strategies.gpipe import GPipeStrategy

    with pytest.raises(ValueError, match=r"GPipeStrategy does not run schedule='zbv'.*"
                                         r"use schedule='zero_bubble'"):  # fmt: skip
        GPipeStrategy(schedule="zbv", chunks=4)


def test_balance_for_devices_minimises_the_busiest_device():
    costs = [2.0, 9.0, 7.5, 7.3, 6.2, 0.1]  # the CIFAR CNN's layers, roughly
    round_robin, v_shape = placement("interleaved", 2), placement("zbv", 2)
    assert balance_by_cost(costs, 4) == [2, 1, 1, 2]  # cheapest largest stage: 18.7 on device 0
    assert balance_for_devices(costs, 4, round_robin) == [1, 2, 2, 1]  # 16.5 / 15.6
    assert balance_for_devices(costs, 4, v_shape) == [1, 1, 1, 3]  # 15.6 / 16.5
    assert balance_for_devices(costs, 2, lambda s: s) == balance_by_cost(costs, 2)
    with pytest.raises(ValueError, match="cannot split 6 layers into 7 stages"):
        balance_for_devices(costs, 7, round_robin)


def test_balance_by_replay_picks_the_cut_whose_schedule_steps_fastest():
    costs = [2.0, 9.0, 7.5, 7.3, 6.2, 0.1]
    where = placement("interleaved", 2)
    plans = [device_schedule("interleaved", 2, 8, 2)]
    # the busiest device is cheapest at [1, 2, 2, 1], but its stage 1 makes device 0 wait
    assert balance_by_replay(costs, plans, 4, where) == [1, 1, 2, 2]
    assert balance_by_replay(costs, [device_schedule("zbv", 2, 8, 2)], 4,
                             placement("zbv", 2)) == [2, 1, 1, 2]  # fmt: skip
    assert balance_by_replay(costs, [device_schedule("1f1b", 2, m) for m in (4, 8)], 2,
                             lambda s: s) == [3, 3]  # fmt: skip
    assert balance_by_replay(costs, [], 4, where) == balance_for_devices(costs, 4, where)
