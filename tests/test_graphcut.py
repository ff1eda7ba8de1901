"""Cutting networks no one here wrote into stages: the chain of stages computes the network's
output and gradients, keeps its parameter names, finds tied weights, and refuses what a
graph cannot hold, with the reason."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from lightning_par.graphcut import (
    UnsplittableModel,
    auto_split_points,
    run_chain,
    split_module,
    trace,
)
from lightning_par.graphcut.auto import candidate_units
from tests._any_models import MODELS, TinyGPT


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output.float().pow(2).mean()


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_chain_of_stages_computes_the_network(name):
    torch.manual_seed(0)
    model, inputs, points = MODELS[name]()
    model.train()  # dropout included: the stages draw the same masks in the same order
    split = split_module(model, inputs, points)
    assert len(split) == len(points) + 1
    torch.manual_seed(1)
    expected_out = model(*inputs)
    _loss(expected_out).backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)

    torch.manual_seed(1)
    out = run_chain(split, *inputs)
    _loss(out).backward()
    torch.testing.assert_close(out.detach(), expected_out.detach())
    got = _grads(model)  # the stages hold the model's own parameters
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], msg=key)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_stages_keep_the_networks_parameter_names(name):
    model, inputs, points = MODELS[name]()
    split = split_module(model, inputs, points)
    names = dict(model.named_parameters(remove_duplicate=False))
    held = [n for stage in split.stages for n in stage.parameter_names]
    assert set(held) <= names.keys()
    for stage in split.stages:  # the very same tensors, not copies
        for n, p in stage.module.named_parameters():
            assert p is names[n]
    assert {id(names[n]) for n in held} == {id(p) for p in model.parameters()}


def test_a_skip_over_a_whole_stage_travels_through_it():
    model, inputs, _ = MODELS["raw_parameters"]()
    split = split_module(model, inputs, ["lin0", "lin1"])
    # relu's output (the skip) is used after lin0's stage: stage 1 receives and passes it on
    skip = next(n for n in split.stages[0].outputs if "relu" in n)
    assert skip in split.stages[1].inputs and skip in split.stages[1].outputs
    assert split.stages[2].inputs == split.stages[1].outputs


def test_tied_embedding_is_shared_by_first_and_last_stage():
    model, inputs, points = MODELS["tiny_gpt"]()
    split = split_module(model, inputs, points)
    assert split.shared == {"wte.weight": (0, 2)}
    last = dict(split.stages[-1].module.named_parameters())
    assert last["lm_head.weight"] is model.wte.weight


def test_a_module_called_in_two_stages_is_shared():
    model, inputs, _ = MODELS["demo_transformer"]()
    # the embedding embeds the source before the cut and the target after it
    split = split_module(model, inputs, ["pos_encoder"])
    assert split.shared == {"embedding.weight": (0, 1)}


def test_no_shared_parameters_in_a_plain_chain():
    model, inputs, points = MODELS["resnet18_group_norm"]()
    assert split_module(model, inputs, points).shared == {}


def test_tracing_leaves_the_users_module_as_it_was():
    model, inputs, points = MODELS["demo_transformer"]()
    split_module(model, inputs, points)
    assert model.src_mask is None and model.pos_encoder.pe is None
    assert isinstance(model(*inputs), torch.Tensor)


def test_graph_is_specialised_to_the_example_shapes_and_traced_again_for_others():
    model, inputs, points = MODELS["cifar_rnn"]()
    split = split_module(model, inputs, points)
    other = torch.randn(2, 3, 32, 32)
    with pytest.raises(RuntimeError):
        run_chain(split, other)  # reshape(b, ...) was traced with b = 4
    again = split_module(model, (other,), points)
    torch.testing.assert_close(run_chain(again, other), model(other))


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        x = self.lin(x)
        if x.sum() > 0:
            return x
        return -x


def test_data_dependent_control_flow_is_refused_naming_the_line():
    with pytest.raises(UnsplittableModel, match=r"data-dependent.*x.sum\(\) > 0"):
        trace(DataDependent(), (torch.randn(2, 4),))


def test_split_point_errors_say_what_to_give():
    model, inputs, _ = MODELS["cifar_cnn"]()
    with pytest.raises(ValueError, match="not a module the network's forward calls"):
        split_module(model, inputs, ["nonexistent"])
    with pytest.raises(ValueError, match="in the order"):
        split_module(model, inputs, ["4", "2"])
    with pytest.raises(ValueError, match="one split point fewer"):
        split_module(model, inputs, ["2"], num_stages=3)


def test_a_tuple_crossing_a_cut_travels_as_its_tensors():
    """An LSTM's (outputs, (h, c)) kept whole across the cut, and its (h, c) returned: the
    stages pass tensors only, and the chain rebuilds the network's own output."""

    class TupleAcross(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(4, 4, batch_first=True)
            self.head = nn.Linear(4, 4)

        def forward(self, x, hidden):
            out = self.lstm(x, hidden)  # (outputs, (h, c)): a tuple
            return self.head(x) + out[0], out[1]

    model = TupleAcross()
    inputs = (torch.randn(2, 3, 4), (torch.randn(1, 2, 4), torch.randn(1, 2, 4)))
    split = split_module(model, inputs, ["head"])
    assert split.stages[1].inputs == ("x", "lstm_0", "lstm_1", "lstm_2")  # its 3 tensors
    got, want = run_chain(split, *inputs), model(*inputs)
    torch.testing.assert_close(got[0], want[0])
    assert isinstance(got[1], tuple) and len(got[1]) == 2
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b)


def test_non_tensor_crossing_a_cut_is_refused():
    class NoneAcross(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(4, 1, batch_first=True)
            self.head = nn.Linear(4, 4)

        def forward(self, x):
            out = self.attn(x, x, x, need_weights=False)  # (outputs, None)
            return self.head(x) + out[0]

    refused = r"'attn' \(tuple\(Tensor, NoneType\).*only tensors \(and tuples/lists of tensors\)"
    with pytest.raises(UnsplittableModel, match=refused):
        split_module(NoneAcross(), (torch.randn(2, 3, 4),), ["head"])


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_auto_split_by_parameters_is_the_best_balance(stages):
    model, inputs, _ = MODELS["resnet18_group_norm"]()
    split = split_module(model, inputs, num_stages=stages)
    sizes = [sum(p.numel() for p in s.module.parameters()) for s in split.stages]
    assert len(sizes) == stages and sum(sizes) == sum(p.numel() for p in model.parameters())
    # against every way to cut ResNet-18's units (the large blocks opened into their layers)
    # into that many consecutive groups
    names = candidate_units(model, stages)
    assert "layer4.1.conv2" in names and "layer1.0" in names
    costs = [sum(p.numel() for p in model.get_submodule(u).parameters()) for u in names]
    best = min(
        max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, len(costs))))
        for cuts in itertools.combinations(range(1, len(costs)), stages - 1)
    )
    assert max(sizes) == best


def test_auto_split_by_time_gives_a_valid_split():
    model, inputs, _ = MODELS["tiny_gpt"]()
    traced = trace(model, inputs)
    points = auto_split_points(model, traced, 2, by="time", inputs=inputs)
    assert len(points) == 1
    torch.testing.assert_close(
        run_chain(split_module(model, inputs, points), *inputs), model(*inputs)
    )


def test_too_many_stages_for_the_units_is_refused():
    with pytest.raises(ValueError, match="too few"):
        split_module(TinyGPT(layers=1), (torch.randint(0, 50, (2, 4)),), num_stages=8)
