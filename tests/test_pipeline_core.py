"""Pipeline core without Lightning: schedules, partitioning, micro-batches, and gradient /
weight equivalence with single-process training over the whole configuration grid."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from lightning_par.comm import CommTrace, Communicator, run_on_ranks
from lightning_par.pipeline import (
    DeviceStages,
    balance_by_cost,
    balance_by_params,
    balance_by_time,
    bubble_fraction,
    check_balance,
    clock_table,
    format_table,
    forward_backward,
    micro_batch_sizes,
    scatter,
    schedule_steps,
    split_sequential,
)
from lightning_par.pipeline.schedule import max_in_flight

# ---- schedules ----------------------------------------------------------------------------


def test_gpipe_schedule_textbook_order():
    assert [str(s) for s in schedule_steps("gpipe", 2, 3)[0]] == [
        "F0",
        "F1",
        "F2",
        "B2",
        "B1",
        "B0",
    ]
    # course material 000: 3 samples through 3 stages take 5 forward slices instead of 9
    table = clock_table("gpipe", 3, 3)
    forward_slots = [row for row in table if any(s is not None and s.op == "fwd" for s in row)]
    assert len(forward_slots) == 5
    assert format_table(table).splitlines()[0] == (
        "stage 0:  F0  F1  F2  ..  ..  ..  ..  B2  B1  B0"
    )
    assert len(clock_table("gpipe", 3, 1)) == 6  # naive: one stage busy at a time


def test_1f1b_schedule_textbook_order():
    # Narayanan et al. 2021, figure 4 (4 stages, 8 micro-batches): stage 0 warms up with 3
    # forwards, then alternates; the last stage alternates from the start.
    steps = schedule_steps("1f1b", 4, 8)
    assert " ".join(map(str, steps[0])) == ("F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7")
    assert " ".join(map(str, steps[3])) == ("F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7")
    assert [max_in_flight(s) for s in steps] == [4, 3, 2, 1]
    assert [max_in_flight(s) for s in schedule_steps("gpipe", 4, 8)] == [8, 8, 8, 8]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,chunks", [(2, 1), (2, 4), (3, 3), (4, 8), (4, 2)])
def test_schedules_complete_with_textbook_bubble(schedule, stages, chunks):
    table = clock_table(schedule, stages, chunks)
    assert len(table) == 2 * (chunks + stages - 1)
    idle = sum(row.count(None) for row in table) / (len(table) * stages)
    assert idle == pytest.approx(bubble_fraction(stages, chunks))
    for steps in schedule_steps(schedule, stages, chunks):
        assert sorted(map(str, steps)) == sorted(
            [f"F{i}" for i in range(chunks)] + [f"B{i}" for i in range(chunks)]
        )


def test_unknown_schedule():
    with pytest.raises(ValueError, match="unknown schedule 'zb'"):
        schedule_steps("zb", 2, 2)


# ---- partitioning and micro-batches ------------------------------------------------------


def test_balance_by_cost_is_optimal():
    assert balance_by_cost([1, 1, 1, 1], 2) == [2, 2]
    assert balance_by_cost([4, 1, 1, 1, 1], 2) == [1, 4]
    assert balance_by_cost([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [5, 2, 2]  # 15 | 13 | 17
    for costs, k in [([3, 1, 4, 1, 5, 9, 2, 6], 3), ([1] * 7, 4)]:
        best = min(
            max(sum(costs[a:b]) for a, b in zip((0,) + cut, cut + (len(costs),)))
            for cut in itertools.combinations(range(1, len(costs)), k - 1)
        )
        bal = balance_by_cost(costs, k)
        bounds = list(itertools.accumulate([0] + bal))
        assert max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])) == best


def test_balance_by_params_and_time():
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 8))
    assert balance_by_params(net, 2) == [1, 3]  # the ReLU joins the next Linear
    before = [p.clone() for p in net.parameters()]
    bal = balance_by_time(net, torch.randn(16, 64), 2)
    assert sum(bal) == 4 and len(bal) == 2
    assert all(p.grad is None for p in net.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


def test_bad_balance_errors():
    net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
    with pytest.raises(ValueError, match="sums to 4 but the network has 3 layers"):
        split_sequential(net, [2, 2])
    with pytest.raises(ValueError, match="4 stages but the network has only 3 layers"):
        check_balance(3, [1, 1, 1, 1])
    with pytest.raises(ValueError, match="3 processes"):
        check_balance(3, [1, 2], world_size=3)
    with pytest.raises(ValueError, match="positive integers"):
        check_balance(3, [0, 3])
    with pytest.raises(TypeError, match="needs an nn.Sequential"):
        split_sequential(nn.ModuleList(list(net)), [1, 2])
    with pytest.raises(ValueError, match="need 1 <= stages <= layers"):
        balance_by_cost([1, 2], 3)


def test_split_keeps_layer_names():
    net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)])
    a, b = split_sequential(net, [2, 3])
    assert list(b.state_dict()) == [
        "2.weight",
        "2.bias",
        "3.weight",
        "3.bias",
        "4.weight",
        "4.bias",
    ]
    assert {**a.state_dict(), **b.state_dict()}.keys() == net.state_dict().keys()


def test_micro_batches():
    assert micro_batch_sizes(10, 4) == [3, 3, 2, 2]
    assert micro_batch_sizes(9, 4) == [3, 2, 2, 2]  # torch.chunk would give 3 pieces
    assert micro_batch_sizes(8, 1) == [8]
    x = torch.arange(11)
    assert torch.equal(torch.cat(scatter(x, 8)), x)
    with pytest.raises(ValueError, match="cannot split a batch of 3 samples into 4"):
        micro_batch_sizes(3, 4)
    with pytest.raises(ValueError, match=">= 1"):
        micro_batch_sizes(3, 0)


# ---- equivalence with one process (the big grid: one fork per number of stages) ----------

BATCH = 11  # uneven micro-batches for M = 2, 4, 8


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for i in range(8):
        layers += [nn.Linear(12, 12), nn.Tanh()] if i % 2 == 0 else [nn.Linear(12, 12)]
    return nn.Sequential(*layers, nn.Linear(12, 5))


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 12, generator=g), torch.randint(0, 5, (BATCH,), generator=g)


def _reference(steps: int = 3):
    net, loss_fn = _net(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    first_grads, losses = None, []
    for step in range(steps):
        x, y = _data(step)
        opt.zero_grad()
        loss = loss_fn(net(x), y)
        loss.backward()
        losses.append(loss.detach())
        if first_grads is None:
            first_grads = {k: p.grad.clone() for k, p in net.named_parameters()}
        opt.step()
    return first_grads, net.state_dict(), losses


def _grid(rank: int, world_size: int, configs) -> list[tuple]:
    ref_grads, ref_weights, ref_losses = _reference()
    comm = Communicator(trace=CommTrace(rank))
    results = []
    for chunks, schedule, mode in configs:
        net = _net()
        balance = balance_by_params(net, world_size)
        module = split_sequential(net, balance)[rank]
        stage = DeviceStages({rank: module}, world_size, comm, checkpoint=mode)
        opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        grad_err = weight_err = loss_err = 0.0
        for step in range(3):
            x, y = _data(step)
            opt.zero_grad()
            loss = forward_backward(stage, x, y, nn.CrossEntropyLoss(), chunks, schedule)
            if stage.is_last:  # every step's loss equals one process's at that step
                loss_err = max(loss_err, float((loss - ref_losses[step]).abs().detach()))
            if step == 0:
                grad_err = max(
                    float((p.grad - ref_grads[k]).abs().max()) for k, p in module.named_parameters()
                )
                kept = {k: b.data_ptr() for k, b in stage._buffers.items()}
            opt.step()
        # every step received into the same buffers, one per micro-batch and direction
        assert {k: b.data_ptr() for k, b in stage._buffers.items()} == kept
        assert len(kept) == chunks * ((not stage.is_first) + (not stage.is_last))
        weight_err = max(
            float((v - ref_weights[k]).abs().max()) for k, v in module.state_dict().items()
        )
        results.append((chunks, schedule, mode, grad_err, weight_err, loss_err))
    # one traced forward span per micro-batch and step, each at least as long as 0 s
    fwd = [e for e in comm.trace.events if e.name == "fwd"]
    assert len(fwd) == 3 * sum(chunks for chunks, _, _ in configs)
    assert sorted({e.micro_batch for e in fwd}) == list(range(max(c for c, _, _ in configs)))
    return results


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_equivalence_grid(stages):
    configs = list(
        itertools.product([1, 2, 4, 8], ["gpipe", "1f1b"], ["never", "except_last", "always"])
    )
    results = run_on_ranks(_grid, stages, configs, timeout=120)
    for rank_results in results:
        assert len(rank_results) == len(configs)
        for chunks, schedule, mode, grad_err, weight_err, loss_err in rank_results:
            where = f"K={stages} M={chunks} {schedule} {mode}"
            assert grad_err < 1e-6, where
            assert weight_err < 1e-5, where
            assert loss_err < 1e-6, where


def _eval_and_trace(rank: int, world_size: int) -> tuple:
    net = _net()
    module = split_sequential(net, [5, 8])[rank]
    comm = Communicator(trace=CommTrace(rank))
    stage = DeviceStages({rank: module}, world_size, comm)
    x, _ = _data(0)
    with torch.no_grad():
        stage.begin(x.shape, 4)
        stage.run(schedule_steps("gpipe", 2, 4)[rank][:4], [t for t in scatter(x, 4)])
        (out,) = stage.share_output([stage.joined_output()] if stage.is_last else None)
        stage.finish()
    expected = _net()(x)
    tags = sorted({m.tag for m in comm.trace.messages})
    return float((out - expected).abs().max()), tags


def test_inference_and_shared_output():
    results = run_on_ranks(_eval_and_trace, 2, timeout=60)
    assert all(err < 1e-6 for err, _ in results)
    assert results[0][1] == ["act", "header", "output"]


def _view_only_last_stage(rank: int, world_size: int) -> float:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 12), nn.Flatten())  # stage 1 holds only a view
    module = split_sequential(net, [1, 1])[rank]
    stage, kept, expected = DeviceStages({rank: module}, world_size, Communicator()), [], []
    with torch.no_grad():
        for step in range(2):  # both steps receive into the same kept buffer
            x, _ = _data(step)
            stage.begin(x.shape, 1)
            stage.run(schedule_steps("gpipe", 2, 1)[rank][:1], [x])
            if stage.is_last:
                kept.append(stage.results[0][0])  # as trainer.predict keeps each batch's output
                expected.append(net(x))
            stage.finish()
    return max(float((k - e).abs().max()) for k, e in zip(kept, expected)) if kept else 0.0


def test_an_output_kept_across_steps_is_not_rewritten_by_the_next_receive():
    assert max(run_on_ranks(_view_only_last_stage, 2, timeout=60)) < 1e-6
