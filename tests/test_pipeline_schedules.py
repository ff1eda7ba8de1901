"""Interleaved 1F1B, zero bubble and ZBV: the step lists, the validator, and the runtime's
weights against one process, on a Linear stack and the CIFAR CNN (tuple-valued stages
included). ZBV's grid and cuts: tests/test_pipeline_zbv.py."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from lightning_par.comm import CommTrace, Communicator, run_on_ranks
from lightning_par.models import CifarCNN
from lightning_par.pipeline import balance_by_params, split_sequential
from lightning_par.pipeline.multistage import DeviceStages
from lightning_par.pipeline.schedule import Step, max_in_flight
from lightning_par.pipeline.schedules import (
    device_schedule,
    formula_bubble,
    get_schedule,
    placement,
)
from lightning_par.pipeline.step import scheduled_step
from lightning_par.pipeline.validate import ScheduleError, simulated_bubble, validate

# ---- the grid: every schedule passes the validator, and its simulated bubble is the formula

GRID = [
    (schedule, k, v, m)
    for schedule in ("gpipe", "1f1b", "interleaved", "zero_bubble")
    for k, v, m in itertools.product([1, 2, 3, 4], [1, 2, 3], [1, 2, 3, 4, 6, 8, 12])
    if (v == 1 or schedule == "interleaved")
    and not (schedule == "interleaved" and m % k)
    and not (schedule == "zero_bubble" and m < k)  # ZB-H1's bubble needs M >= K
]


@pytest.mark.parametrize("schedule,k,v,m", GRID)
def test_every_schedule_passes_the_validator_with_its_textbook_bubble(schedule, k, v, m):
    steps = device_schedule(schedule, k, m, v)
    timed = validate(steps, num_stages=k * v, chunks=m)
    assert simulated_bubble(timed, k) == pytest.approx(formula_bubble(schedule, k, m, v))


def test_interleaved_order_is_megatrons():
    # K = 2 devices, v = 2 (device 0 holds stages 0 and 2), M = 4: groups of K micro-batches
    # go round the device's stages; 2(K-d-1) + (v-1)K = 4 warm-up forwards on device 0
    steps = device_schedule("interleaved", 2, 4, 2)
    assert [f"{s}@{s.stage}" for s in steps[0]] == (
        "F0@0 F1@0 F0@2 F1@2 F2@0 B0@2 F3@0 B1@2 F2@2 B0@0 F3@2 B1@0 B2@2 B3@2 B2@0 B3@0".split()
    )
    assert {s.stage for s in steps[1]} == {1, 3}
    # the first device holds fewer micro-batch stages than GPipe's v*M
    assert max_in_flight(steps[0]) == 5 < 2 * 4
    with pytest.raises(ValueError, match="multiple of the 2 devices.*use chunks=4 or 2"):
        device_schedule("interleaved", 2, 3, 2)


def test_zero_bubble_fills_the_drain_with_weight_gradients():
    steps = device_schedule("zero_bubble", 4, 8)
    first = " ".join(map(str, steps[0]))
    assert first.startswith("F0 F1 F2 F3 B0 F4 B1")  # 1F1B's warm-up and B/F alternation
    assert first.endswith("B5 W3 W4 B6 W5 W6 B7 W7")  # W where 1F1B's first stage waits
    for lst in steps:
        assert sorted(map(str, lst)) == sorted(f"{c}{i}" for c in "FBW" for i in range(8))
    assert formula_bubble("zero_bubble", 4, 8) < formula_bubble("1f1b", 4, 8) / 2


# ---- the validator names the step that breaks a rule


def _swap(lst: list[Step], a: int, b: int) -> list[Step]:
    lst = list(lst)
    lst[a], lst[b] = lst[b], lst[a]
    return lst


def test_validator_names_the_step_that_breaks_a_rule():
    good = device_schedule("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match=r"device 0, step #0 \(B0: backward .* comes before"):
        validate([_swap(good[0], 0, 2), good[1]])
    with pytest.raises(ScheduleError, match="device 0 never runs the backward of micro-batch 1"):
        validate([good[0][:-1], good[1]], num_stages=2, chunks=2)
    with pytest.raises(ScheduleError, match="stage 1 lives on device 1, not 0"):
        validate([good[0] + [Step(1, "fwd", 0)], good[1]])
    twice = r"device 1, step #4 \(F1: forward .*\): runs twice \(first at step #2\)"
    with pytest.raises(ScheduleError, match=twice):
        validate([good[0], good[1] + [Step(1, "fwd", 1)]])
    # stage 1 asks for micro-batch 1's activation first, but stage 0 sends micro-batch 0's first
    wrong = [Step(1, "fwd", 1), Step(1, "bwd", 1), Step(1, "fwd", 0), Step(1, "bwd", 0)]
    sender = [Step(0, "fwd", 0), Step(0, "fwd", 1), Step(0, "bwd", 1), Step(0, "bwd", 0)]
    with pytest.raises(ScheduleError, match=r"device 1, step #0 .* would get the activation "
                                            r"for micro-batch 0 of stage 1"):  # fmt: skip
        validate([sender, wrong])
    zb = device_schedule("zero_bubble", 2, 2)
    w_first = [s for s in zb[1] if s.op == "bwd_weight"][:1] + [
        s for s in zb[1] if s.op != "bwd_weight" or s.micro_batch
    ]
    with pytest.raises(ScheduleError, match=r"device 1, step #0 \(W0.*comes before the forward"):
        validate([zb[0], w_first])
    # stage 0 runs B1 before B0, but stage 1 sends B0's gradient first
    early = [Step(0, "fwd", 0), Step(0, "fwd", 1), Step(0, "bwd", 1), Step(0, "bwd", 0)]
    with pytest.raises(ScheduleError, match=r"step #2 .* would get the gradient for "
                                            r"micro-batch 0 of stage 0"):  # fmt: skip
        validate([early, good[1]])
    # v = 2: device 0 (stages 0, 2) starts with stage 2, which waits for device 1's stage 1,
    # but device 1 starts with stage 3, which waits for device 0's stage 2
    f, b = (lambda s, i: Step(s, "fwd", i)), (lambda s, i: Step(s, "bwd", i))
    loop = [[f(2, 0), f(0, 0), b(2, 0), b(0, 0)], [f(3, 0), f(1, 0), b(3, 0), b(1, 0)]]
    with pytest.raises(ScheduleError, match=r"deadlock: .*device 0, step #0 \(F0: forward of "
                                            r"micro-batch 0 on stage 2\) waits for the forward "
                                            r"of micro-batch 0 on stage 1"):  # fmt: skip
        validate(loop)
    one_device = [[Step(1, "fwd", 0), Step(0, "fwd", 0), Step(1, "bwd", 0), Step(0, "bwd", 0)]]
    with pytest.raises(ScheduleError, match=r"deadlock: .*device 0, step #0 \(F0: forward of "
                                            r"micro-batch 0 on stage 1\) waits for the forward "
                                            r"of micro-batch 0 on stage 0"):  # fmt: skip
        validate(one_device, device_of=lambda s: 0)


# ---- the runtime: weights after k steps equal one process's -------------------------------

BATCH = 12


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(6):
        layers += [nn.Linear(10, 10), nn.Tanh()] if i % 2 == 0 else [nn.Linear(10, 10)]
    # a normalisation layer: its W, like a Linear's, must reach the one-process weights
    return nn.Sequential(*layers, nn.LayerNorm(10), nn.Linear(10, 4))


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(BATCH, 10, generator=g), torch.randint(0, 4, (BATCH,), generator=g)


def _cnn() -> nn.Sequential:
    """The course's CIFAR CNN (GroupNorm, residual blocks), narrow, on 16 x 16 inputs."""
    torch.manual_seed(0)
    return CifarCNN(width=8).net


def _cnn_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(BATCH, 3, 16, 16, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


MODELS = {"linear": (_net, _data), "cnn": (_cnn, _cnn_data)}


def _train_one_process(net: nn.Module, steps: int, forward=None, data=_data):
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = data(step)
        opt.zero_grad()
        out = forward(x) if forward else net(x)
        loss = nn.functional.cross_entropy(out, y)
        loss.backward()
        losses.append(float(loss))
        opt.step()
    return net.state_dict(), losses


def _device_stages(rank: int, k: int, v: int, schedule: str, modules: list[nn.Module]):
    where = placement(schedule, k)  # round-robin, or ZBV's V
    mine = {s: modules[s] for s in range(k * v) if where(s) == rank}
    comm = Communicator(trace=CommTrace(rank))
    device = DeviceStages(mine, k * v, comm, device_of=where,
                          split_backward=get_schedule(schedule).split_backward)  # fmt: skip
    return device, mine


def _exact(rank: int, world_size: int, configs, model: str = "linear") -> list[tuple]:
    torch.set_num_threads(1)
    make, data = MODELS[model]
    ref_weights, ref_losses = _train_one_process(make(), 3, data=data)
    results = []
    for schedule, v, m in configs:
        net = make()
        modules = split_sequential(net, balance_by_params(net, world_size * v))
        device, mine = _device_stages(rank, world_size, v, schedule, modules)
        params = [p for mod in mine.values() for p in mod.parameters()]
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        loss_err = 0.0
        for step in range(3):
            x, y = data(step)
            opt.zero_grad()
            _, loss = scheduled_step(device, x, y, nn.CrossEntropyLoss(), m, schedule, v)
            if loss is not None:
                loss_err = max(loss_err, abs(float(loss) - ref_losses[step]))
            opt.step()
        weights = {k: t for mod in mine.values() for k, t in mod.state_dict().items()}
        weight_err = max(float((t - ref_weights[k]).abs().max()) for k, t in weights.items())
        ops = {e.name for e in device.comm.trace.events}
        results.append((schedule, v, m, weight_err, loss_err, ops))
    return results


@pytest.mark.parametrize("k", [2, 3])
def test_new_schedules_match_one_process(k):
    configs = [("interleaved", 2, k), ("interleaved", 2, 2 * k), ("zero_bubble", 1, k),
               ("zero_bubble", 1, 4), ("zero_bubble", 1, 1), ("1f1b", 1, 4),
               ("zbv", 2, k), ("zbv", 2, 2 * k), ("zbv", 2, 1)]  # fmt: skip
    if k == 2:
        configs += [("interleaved", 3, 4), ("gpipe", 1, 3)]
    for rank_results in run_on_ranks(_exact, k, configs, timeout=120):
        for schedule, v, m, weight_err, loss_err, ops in rank_results:
            where = f"K={k} v={v} M={m} {schedule}"
            assert weight_err < 1e-5, where
            assert loss_err < 1e-5, where
            if get_schedule(schedule).split_backward:  # the split really ran
                assert {"fwd", "bwd_input", "bwd_weight"} <= ops, where


def test_new_schedules_match_one_process_on_the_cnn():
    configs = [("zbv", 2, 4), ("zbv", 2, 2), ("interleaved", 2, 4), ("zero_bubble", 1, 4)]
    for rank_results in run_on_ranks(_exact, 2, configs, "cnn", timeout=180):
        for schedule, v, m, weight_err, loss_err, ops in rank_results:
            assert weight_err < 1e-5 and loss_err < 1e-5, (schedule, v, m, weight_err, loss_err)
            if get_schedule(schedule).split_backward:  # the split really ran
                assert {"fwd", "bwd_input", "bwd_weight"} <= ops, schedule


# ---- stages that pass tuples: a skip connection and an integer mask cross the cut ---------


class _Split(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor):
        keep = (x[:, :1] > 0).long()  # an integer tensor: travels forward only
        return torch.tanh(self.a(x)), x * 2, keep


class _Merge(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b, self.c = nn.Linear(10, 10), nn.Linear(10, 4)

    def forward(self, h: torch.Tensor, skip: torch.Tensor, keep: torch.Tensor):
        return self.c(torch.tanh(self.b(h)) + skip * keep)


class _Mid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.m = nn.Linear(10, 10)

    def forward(self, h: torch.Tensor, skip: torch.Tensor, keep: torch.Tensor):
        return self.m(h), skip, keep


def _tuple_stages() -> list[nn.Module]:
    torch.manual_seed(1)
    return [_Split(), _Mid(), _Mid(), _Merge()]


def _tuples(rank: int, world_size: int, schedule: str, v: int) -> tuple[float, float]:
    stages = _tuple_stages()

    def whole(x: torch.Tensor) -> torch.Tensor:
        out = (x,)
        for stage in stages:
            out = stage(*out)
            out = out if isinstance(out, tuple) else (out,)
        return out[0]

    ref_weights, ref_losses = _train_one_process(nn.ModuleList(stages), 2, forward=whole)
    modules = _tuple_stages()
    device, mine = _device_stages(rank, world_size, v, schedule, modules)
    opt = torch.optim.SGD([p for m in mine.values() for p in m.parameters()], lr=0.1,
                          momentum=0.9)  # fmt: skip
    loss_err = 0.0
    for step in range(2):
        x, y = _data(step)
        opt.zero_grad()
        _, loss = scheduled_step(device, x, y, nn.CrossEntropyLoss(), 4, schedule, v)
        if loss is not None:
            loss_err = abs(float(loss) - ref_losses[step])
        opt.step()
    err = max(float((t - ref_weights[f"{s}.{k}"]).abs().max())
              for s, mod in mine.items() for k, t in mod.state_dict().items())  # fmt: skip
    return err, loss_err


@pytest.mark.parametrize("schedule,v", [("interleaved", 2), ("zero_bubble", 1)])
def test_stages_pass_tuples_of_tensors(schedule, v):
    k = 4 // v
    for weight_err, loss_err in run_on_ranks(_tuples, k, schedule, v, timeout=120):
        assert weight_err < 1e-5 and loss_err < 1e-5
