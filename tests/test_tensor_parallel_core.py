"""Tensor-parallel layers as plain modules (no Lightning): after SGD steps the split model's
weights, assembled from the ranks, equal one process's; the operators' bytes equal the cost
model's; plans refuse what they cannot split."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_par.comm import CommTrace, Communicator, run_on_ranks
from lightning_par.models import CifarCNN, CifarRNN
from lightning_par.tensorparallel import (
    TPGroup,
    all_gather,
    assemble_optimizer_state,
    assemble_state_dict,
    module_shards,
    parallelize,
    parameter_shards,
    reduce_scatter,
    resolve_plan,
    shard_optimizer_state,
    shard_state_dict,
)
from lightning_par.tensorparallel.clip import clip_grad_norm_split
from lightning_par.tensorparallel.cost import all_gather_cost, reduce_scatter_cost


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 10), nn.ReLU(), nn.Linear(10, 7), nn.Tanh(),
                         nn.Linear(7, 9), nn.GELU(), nn.Linear(9, 5))  # fmt: skip


def model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.ModuleDict({"net": mlp()})
    if kind == "cnn":
        return CifarCNN(width=24, num_blocks=2, norm="group")
    return CifarRNN(hidden_size=10, num_layers=2)


def batch(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    # small images keep it quick: the CNN pools any size, the RNN reads 16 rows of 96 values
    x = torch.randn(4, 12, generator=g) if kind == "mlp" else torch.randn(4, 3, 16, 32, generator=g)
    return x, torch.randint(0, 5, (4,), generator=g)


def train(net: nn.Module, kind: str, steps: int = 3):
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    x, y = batch(kind)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(net["net"](x) if kind == "mlp" else net(x), y).backward()
        opt.step()
    return opt


def _split_training(rank, world, kind):
    net = model(kind)
    plan = parallelize(net, Communicator())
    opt = train(net, kind)
    return net.state_dict(), opt.state_dict(), plan, module_shards(net), parameter_shards(net)


# (the Lightning strategy's tests cover the other world size of each model)
@pytest.mark.parametrize("kind, world", [("mlp", 2), ("mlp", 3), ("cnn", 3), ("rnn", 2)])
def test_weights_and_optimizer_state_equal_one_process(kind, world):
    reference = model(kind)
    ref_opt = train(reference, kind)
    results = run_on_ranks(_split_training, world, kind)
    states, opt_states, plan, shards, pshards = zip(*results)
    assert plan[0].cuts, "nothing was split"
    full = assemble_state_dict(states, shards[0])
    expected = reference.state_dict()
    assert full.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(full[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)
    # the optimiser state in one process's own format (momentum buffers of full shape)
    got = assemble_optimizer_state(opt_states, pshards[0])
    want = ref_opt.state_dict()
    for index, values in want["state"].items():
        for name, value in values.items():
            torch.testing.assert_close(got["state"][index][name], value, rtol=1e-5, atol=1e-6)
    # and back: each rank's slices from one process's state
    for rank in range(world):
        cut = shard_optimizer_state(want, pshards[0], rank)
        for index, values in cut["state"].items():
            for name, value in values.items():
                assert value.shape == opt_states[rank]["state"][index][name].shape
        local = shard_state_dict(expected, shards[0], rank)
        assert {k: v.shape for k, v in local.items()} == {
            k: v.shape for k, v in states[rank].items()
        }


def test_automatic_plans_of_the_example_models():
    cnn = resolve_plan(model("cnn"), 3)
    assert [(c.name, c.style) for c in cnn.cuts[:3]] == [
        ("net.1.body.0", "column"), ("net.1.body.1", "norm"), ("net.1.body.3", "row")]  # fmt: skip
    assert "net.0.0" in cnn.replicated  # the stem has no partner
    rnn = resolve_plan(model("rnn"), 3)
    assert [(c.name, c.style, c.sizes) for c in rnn.cuts] == [
        ("net.1.lstm", "lstm", (4, 3, 3)), ("net.2.lstm", "lstm", (4, 3, 3))]  # fmt: skip
    # a GroupNorm of one group cannot be cut: that block stays whole
    small = resolve_plan(CifarCNN(width=8, num_blocks=2), 2)
    assert "1 GroupNorm groups cannot be split over 2 ranks" in small.replicated["net.1.body.0"]


@pytest.mark.parametrize(
    "plan, message",
    [
        ({"net.0": "column"}, "must be followed, in its nn.Sequential, by a 'row' layer"),
        ({"net.2": "row"}, "needs a 'column' layer right before it"),
        ({"net.1": "column"}, "is a ReLU"),
        ({"net.9": "row"}, "no module named 'net.9'"),
        ({"net.0": "diagonal"}, "is not one of"),
        ({"net.4": "column", "net.6": "row"}, "9 features cannot be split over 12 ranks"),
    ],
)
def test_user_plans_refused_naming_the_layer(plan, message):
    with pytest.raises(ValueError, match="tensor_parallel plan") as err:
        resolve_plan(model("mlp"), 12, plan)
    assert message in str(err.value)


def _collectives(rank, world, sizes, rest):
    trace = CommTrace(rank)
    group = TPGroup(Communicator(trace=trace))
    local = torch.full((sizes[rank], rest), float(rank + 1))
    gathered = all_gather(local, sizes, 0, group)
    full = torch.arange(sum(sizes) * rest, dtype=torch.float32).view(-1, rest) * (rank + 1)
    mine = reduce_scatter(full, sizes, 0, group)
    return gathered, mine, trace.bytes_sent


@pytest.mark.parametrize("sizes", [(3, 1, 2), (2, 2)])
def test_all_gather_and_reduce_scatter_of_unequal_slices(sizes):
    world, rest = len(sizes), 4
    results = run_on_ranks(_collectives, world, sizes, rest)
    expected = torch.cat([torch.full((s, rest), float(k + 1)) for k, s in enumerate(sizes)])
    total = torch.arange(sum(sizes) * rest, dtype=torch.float32).view(-1, rest)
    total = total * sum(range(1, world + 1))
    start = 0
    for rank, (gathered, mine, nbytes) in enumerate(results):
        torch.testing.assert_close(gathered, expected)
        torch.testing.assert_close(mine, total[start : start + sizes[rank]])
        start += sizes[rank]
        # gather: every slice but the right neighbour's; reduce-scatter: all but its own
        others = sum(sizes) - sizes[(rank + 1) % world] + sum(sizes) - sizes[rank]
        assert nbytes == others * rest * 4
        model = all_gather_cost(sizes, rest).bytes_sent[rank]
        assert nbytes == model + reduce_scatter_cost(sizes, rest).bytes_sent[rank]


def test_shard_round_trip_of_lstm_gates():
    lstm = nn.LSTM(5, 7, batch_first=True)
    state = copy.deepcopy(lstm.state_dict())
    from lightning_par.tensorparallel import Shard

    shard = Shard(0, (3, 2, 2), groups=4)
    parts = [shard.take(state["weight_hh_l0"], r) for r in range(3)]
    assert [p.shape[0] for p in parts] == [12, 8, 8]
    torch.testing.assert_close(shard.assemble(parts), state["weight_hh_l0"])
    # rank 1 holds units 3, 4 of each gate i, f, g, o
    rows = [g * 7 + u for g in range(4) for u in (3, 4)]
    torch.testing.assert_close(parts[1], state["weight_hh_l0"][rows])


def _clipped_gradients(rank, world, max_norm):
    net = model("mlp")
    comm = Communicator()
    parallelize(net, comm)
    x, y = batch("mlp")
    nn.functional.cross_entropy(net["net"](x), y).backward()
    shards = module_shards(net)
    params = dict(net.named_parameters())
    total = clip_grad_norm_split([p for n, p in params.items() if n in shards],
                                 [p for n, p in params.items() if n not in shards],
                                 max_norm, TPGroup(comm))  # fmt: skip
    return float(total), {n: p.grad for n, p in params.items()}, shards


def test_clipping_by_norm_uses_the_whole_models_norm():
    reference = model("mlp")
    x, y = batch("mlp")
    nn.functional.cross_entropy(reference["net"](x), y).backward()
    want = float(nn.utils.clip_grad_norm_(reference.parameters(), 0.1))
    results = run_on_ranks(_clipped_gradients, 3, 0.1)
    totals, grads, shards = zip(*results)
    assert totals == pytest.approx([want] * 3, rel=1e-5)
    assert want > 0.1, "the test must clip"
    full = assemble_state_dict(grads, shards[0])
    for name, p in reference.named_parameters():
        torch.testing.assert_close(full[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
