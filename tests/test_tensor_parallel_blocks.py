"""Tensor parallelism for the layers real networks have, as plain modules (no Lightning):
a torchvision MLP with dropout between its layers, torch's Transformer layers (attention
split by heads, the feed-forward pair), an embedding split by vocabulary, an MLP with one
layer applied twice (kept whole: a cut would untie its two uses). After SGD steps
with dropout on, the weights assembled from the ranks equal one process's with the same
seed; what cannot be split exactly is refused or left replicated with the reason."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

from lightning_par.comm import Communicator, run_on_ranks
from lightning_par.tensorparallel import (
    ParallelMultiheadAttention,
    TPGroup,
    assemble_state_dict,
    module_shards,
    parallelize,
    resolve_plan,
)


class TokenModel(nn.Module):
    """Embedding -> two Transformer encoder layers -> a classifier over the mean token."""

    def __init__(self, dropout: float, vocab: int = 23, width: int = 16, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=3)
        self.layers = nn.Sequential(
            *(
                nn.TransformerEncoderLayer(width, heads, 24, dropout=dropout, batch_first=True)
                for _ in range(2)
            )
        )
        self.head = nn.Linear(width, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.embed(tokens)).mean(1))


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "torchvision_mlp":  # Linear, ReLU, Dropout, Linear, Dropout
        return torchvision.ops.MLP(12, [20, 5], dropout=0.3)
    if kind == "shared_layer":  # "2" applied again as "4"; "6" -> "8" is a pair to cut
        shared = nn.Linear(16, 16)
        return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), shared, nn.Tanh(), shared, nn.Tanh(),
                             nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 5))  # fmt: skip
    return TokenModel(dropout=0.0 if kind == "transformer" else 0.2)


def batch(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 12, generator=g) if kind in ("torchvision_mlp", "shared_layer") else None
    if x is None:
        x = torch.randint(0, 23, (6, 7), generator=g)
    return x, torch.randint(0, 5, (6,), generator=g)


def train(net: nn.Module, kind: str, steps: int = 3) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = batch(kind)
    for step in range(steps):
        torch.manual_seed(100 + step)  # the same dropout masks in one process and the split
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()


def _split_training(rank, world, kind):
    net = build(kind)
    plan = parallelize(net, Communicator(), root="")
    train(net, kind)
    return net.state_dict(), module_shards(net), plan


@pytest.mark.parametrize(
    "kind, world",
    [
        ("torchvision_mlp", 2),
        ("torchvision_mlp", 3),
        ("transformer", 2),
        ("transformer_dropout", 2),
        ("shared_layer", 2),
    ],
)
def test_weights_equal_one_process_with_dropout_on(kind, world):
    reference = build(kind)
    train(reference, kind)
    states, shards, plans = zip(*run_on_ranks(_split_training, world, kind))
    full = assemble_state_dict(states, shards[0])
    expected = reference.state_dict()
    assert full.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(full[key], expected[key], msg=key, atol=2e-5, rtol=1e-4)
    styles = {cut.style for cut in plans[0].cuts}
    if kind == "shared_layer":
        assert [(c.name, c.style) for c in plans[0].cuts] == [("6", "column"), ("8", "row")]
        return
    assert {"column", "row", "dropout"} <= styles or kind == "transformer"
    if kind.startswith("transformer"):
        assert "vocab" in styles


def test_plans_name_what_they_cut_and_why_the_rest_stays():
    mlp = resolve_plan(build("torchvision_mlp"), 2, root="")
    assert [(c.name, c.style) for c in mlp.cuts] == [
        ("0", "column"),
        ("2", "dropout"),
        ("3", "row"),
    ]
    plain = resolve_plan(build("transformer"), 2, root="")
    assert ("layers.0.self_attn", "heads") in [(c.name, c.style) for c in plain.cuts]
    assert ("embed", "vocab") in [(c.name, c.style) for c in plain.cuts]
    dropped = resolve_plan(build("transformer_dropout"), 2, root="")
    assert "attention dropout" in dropped.replicated["layers.0.self_attn"]
    assert ("layers.0.linear1", "column") in [(c.name, c.style) for c in dropped.cuts]


def test_a_tied_embedding_stays_replicated():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.out = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
            self.out.weight = self.embed.weight

    plan = resolve_plan(Tied(), 2, root="")
    assert "tied" in plan.replicated["embed"]


def test_a_layer_used_at_two_places_stays_whole_and_a_plan_cutting_it_is_refused():
    """A cut replaces a layer at one name: the other place would keep the old weights and the
    two would train apart (and a checkpoint hold both)."""
    plan = resolve_plan(build("shared_layer"), 2, root="")
    assert "applied twice" in plan.replicated["2"]
    assert "the layer after it, 2: its weights are used at another place" in plan.replicated["0"]
    layer = nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, batch_first=True)
    blocks = resolve_plan(nn.Sequential(layer, layer), 2, root="")
    assert not blocks.cuts and "applied twice" in blocks.replicated["0"]
    with pytest.raises(ValueError, match="'2': its weights are used at another place too"):
        resolve_plan(build("shared_layer"), 2, {"0": "column", "2": "row"}, root="")


def test_user_plan_refusals_give_the_reason():
    with pytest.raises(ValueError, match="attention dropout 0.2"):
        resolve_plan(build("transformer_dropout"), 2, {"layers.0.self_attn": "heads"}, root="")
    with pytest.raises(ValueError, match="max_norm"):
        resolve_plan(nn.ModuleDict({"e": nn.Embedding(10, 4, max_norm=1.0)}), 2, {"e": "vocab"})
    with pytest.raises(ValueError, match="is a Linear; style 'heads' splits an nn.Multihead"):
        resolve_plan(build("torchvision_mlp"), 2, {"0": "heads"}, root="")


def test_column_gather_on_a_convolution_that_changes_width_is_accepted():
    convs = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())
    plan = resolve_plan(convs, 2, {"0": "column_gather"})
    assert plan.cuts[0].sizes == (4, 4)
    grouped = nn.Sequential(nn.Conv2d(4, 8, 3, groups=2))
    with pytest.raises(ValueError, match="groups=2"):
        resolve_plan(grouped, 2, {"0": "column_gather"})


def _attention(rank, world, batch_first, masks):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(12, 6, batch_first=batch_first)
    g = torch.Generator().manual_seed(2)
    q, kv = torch.randn(3, 5, 12, generator=g), torch.randn(3, 4, 12, generator=g)
    if not batch_first:
        q, kv = q.transpose(0, 1), kv.transpose(0, 1)
    kwargs = {}
    if masks:
        kwargs["key_padding_mask"] = torch.tensor([[0, 0, 0, 1]] * 3, dtype=torch.bool)
        kwargs["attn_mask"] = torch.randn(3 * 6, 5, 4, generator=g)
    expected_out, expected_weights = mha(q, kv, kv, **kwargs)
    split = ParallelMultiheadAttention(
        mha, TPGroup(Communicator()), (2, 2, 2)[:world] if world == 3 else (3, 3)
    )
    out, weights = split(q, kv, kv, **kwargs)
    return (out - expected_out).abs().max().item(), (weights - expected_weights).abs().max().item()


@pytest.mark.parametrize("batch_first, masks, world", [(True, True, 3), (False, False, 2)])
def test_split_attention_computes_torchs_attention(batch_first, masks, world):
    for out_error, weight_error in run_on_ranks(_attention, world, batch_first, masks):
        assert out_error < 1e-5 and weight_error < 1e-6


def _draw_after_sharing(rank, world):
    from lightning_par.tensorparallel.random import share_random_state

    torch.manual_seed(rank)  # as popen ranks that never agreed on a seed
    before = torch.rand(3)
    torch.manual_seed(10 + rank)
    share_random_state(Communicator(), torch.device("cpu"))
    return before, torch.rand(3)


def test_ranks_draw_rank_zeros_numbers_after_sharing_the_random_state():
    (before0, after0), *others = run_on_ranks(_draw_after_sharing, 3)
    torch.manual_seed(10)
    assert torch.equal(after0, torch.rand(3))
    for before, after in others:
        assert not torch.equal(before, before0) and torch.equal(after, after0)
