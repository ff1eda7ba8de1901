"""ZBV (zero bubble, V-shaped stages): the step lists over the validator's grid, the stage
cut that balances devices, and the runtime's weights against one process on the CNN."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from lightning_par.comm import CommTrace, Communicator, run_on_ranks
from lightning_par.models import CifarCNN
from lightning_par.pipeline import split_sequential
from lightning_par.pipeline.multistage import DeviceStages
from lightning_par.pipeline.partition import (
    balance_by_cost,
    balance_by_replay,
    balance_for_devices,
)
from lightning_par.pipeline.schedule import max_in_flight
from lightning_par.pipeline.schedules_v import (
    SPLIT_SCHEDULES,
    device_schedule,
    formula_bubble,
    placement,
)
from lightning_par.pipeline.schedules_zbv import v_device_of
from lightning_par.pipeline.step import scheduled_step
from lightning_par.pipeline.validate import ScheduleError, simulated_bubble, validate

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


# ---- the runtime on the CIFAR CNN (GroupNorm, residual blocks) against one process ----------

BATCH = 8


def _cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return CifarCNN(width=8).net


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(BATCH, 3, 16, 16, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def _cnn_exact(rank: int, k: int, configs) -> list[tuple]:
    torch.set_num_threads(1)  # k: the world size (devices)
    net = _cnn()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    ref_losses = []
    for step in range(2):
        x, y = _data(step)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        ref_losses.append(float(loss))
        opt.step()
    ref = net.state_dict()
    results = []
    for schedule, v, m, balance in configs:
        where = placement(schedule, k)
        modules = split_sequential(_cnn(), balance)
        mine = {s: modules[s] for s in range(k * v) if where(s) == rank}
        device = DeviceStages(mine, k * v, Communicator(trace=CommTrace(rank)), device_of=where,
                              split_backward=schedule in SPLIT_SCHEDULES)  # fmt: skip
        opt = torch.optim.SGD([p for mod in mine.values() for p in mod.parameters()], lr=0.1,
                              momentum=0.9)  # fmt: skip
        loss_err = 0.0
        for step in range(2):
            x, y = _data(step)
            opt.zero_grad()
            _, loss = scheduled_step(device, x, y, nn.CrossEntropyLoss(), m, schedule, v)
            if loss is not None:
                loss_err = max(loss_err, abs(float(loss) - ref_losses[step]))
            opt.step()
        err = max(float((t - ref[name]).abs().max())
                  for mod in mine.values() for name, t in mod.state_dict().items())  # fmt: skip
        ops = {e.name for e in device.comm.trace.events}
        results.append((schedule, m, err, loss_err, ops))
    return results


def test_zbv_and_the_other_schedules_match_one_process_on_the_cnn():
    configs = [("zbv", 2, 4, [2, 1, 1, 2]), ("zbv", 2, 2, [1, 1, 1, 3]),
               ("interleaved", 2, 4, [1, 2, 2, 1]), ("zero_bubble", 1, 4, [3, 3])]  # fmt: skip
    for rank_results in run_on_ranks(_cnn_exact, 2, configs, timeout=180):
        for schedule, m, err, loss_err, ops in rank_results:
            assert err < 1e-5 and loss_err < 1e-5, (schedule, m, err, loss_err)
            if schedule in SPLIT_SCHEDULES:
                assert {"fwd", "bwd_input", "bwd_weight"} <= ops, schedule
