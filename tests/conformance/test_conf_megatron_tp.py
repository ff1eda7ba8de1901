"""Megatron-LM's tensor-parallel tests, written anew for this project's operators (after
``NVIDIA/Megatron-LM``, ``tests/unit_tests/tensor_parallel/test_mappings.py`` and
``test_layers.py``/``test_initialization.py``: each mapping applied to rank-valued tensors,
forward and backward, with an exactly known result; a split layer's shard equals the
matching slice of the unsplit layer built from the same seed).

Rank ``r`` of ``p`` holds values ``r + 1``, so every sum is ``p (p + 1) / 2`` and every
gathered tensor is known; p = 3 with unequal slices (2, 3, 2) (Megatron asserts equal ones;
we allow any split), every allreduce algorithm for ``f``/``g``.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_par.collectives import ALGORITHMS
from lightning_par.comm import Communicator, run_on_ranks
from lightning_par.tensorparallel.layers import ColumnParallelLinear, RowParallelLinear
from lightning_par.tensorparallel.mappings import (
    TPGroup,
    copy_to,
    gather_from,
    reduce_from,
    split_to,
)

SIZES = (2, 3, 2)


def _mappings(rank: int, world: int) -> list[str]:
    wrong: list[str] = []
    total = world * (world + 1) / 2
    offsets = [sum(SIZES[:k]) for k in range(world)]
    for algorithm in ALGORITHMS:
        group = TPGroup(Communicator(), algorithm)
        value = float(rank + 1)
        # f (copy_to): forward identity, backward allreduce of the gradient
        x = torch.full((4, 5), value, requires_grad=True)
        y = copy_to(x, group)
        (y * value).sum().backward()  # this rank's gradient: r + 1 everywhere
        if not torch.equal(y, x.detach()) or not torch.equal(x.grad, torch.full((4, 5), total)):
            wrong.append(f"{algorithm}: copy_to")
        # g (reduce_from): forward allreduce, backward identity
        x = torch.full((4, 5), value, requires_grad=True)
        y = reduce_from(x, group)
        (y * value).sum().backward()
        if not torch.equal(y, torch.full((4, 5), total)) or not torch.equal(
            x.grad, torch.full((4, 5), value)
        ):
            wrong.append(f"{algorithm}: reduce_from")
    group = TPGroup(Communicator())
    # gather_from: forward all-gather of the slices, backward keeps this rank's slice
    x = torch.full((2, SIZES[rank]), float(rank + 1), requires_grad=True)
    y = gather_from(x, group, SIZES, -1)
    expected = torch.cat([torch.full((2, s), float(k + 1)) for k, s in enumerate(SIZES)], -1)
    weight = torch.arange(float(sum(SIZES))).expand(2, -1)
    (y * weight).sum().backward()
    mine = weight[:, offsets[rank] : offsets[rank] + SIZES[rank]]
    if not torch.equal(y, expected) or not torch.equal(x.grad, mine):
        wrong.append("gather_from")
    # split_to: forward keeps this rank's slice, backward all-gathers the gradient
    x = torch.arange(float(sum(SIZES))).expand(2, -1).clone().requires_grad_(True)
    y = split_to(x, group, SIZES, -1)
    (y * float(rank + 1)).sum().backward()
    if not torch.equal(y, x.detach()[:, offsets[rank] : offsets[rank] + SIZES[rank]]):
        wrong.append("split_to forward")
    if not torch.equal(x.grad, expected):  # rank k's slice of the gradient is k + 1
        wrong.append("split_to backward")
    return wrong


def test_mappings_on_rank_values_give_the_known_sums():
    for rank, wrong in enumerate(run_on_ranks(_mappings, 3)):
        assert wrong == [], f"rank {rank}: {wrong}"


def _shards(rank: int, world: int) -> list[str]:
    torch.manual_seed(1234)  # every rank builds the unsplit layers from the same seed
    first, second = nn.Linear(6, sum(SIZES)), nn.Linear(sum(SIZES), 4)
    group = TPGroup(Communicator())
    column = ColumnParallelLinear(first, group, SIZES)
    row = RowParallelLinear(second, group, SIZES)
    start, end = sum(SIZES[:rank]), sum(SIZES[: rank + 1])
    wrong = []
    if not torch.equal(column.weight, first.weight[start:end]):
        wrong.append("column weight is not rows [start:end] of the unsplit weight")
    if not torch.equal(column.bias, first.bias[start:end]):
        wrong.append("column bias")
    if not torch.equal(row.weight, second.weight[:, start:end]):
        wrong.append("row weight is not columns [start:end] of the unsplit weight")
    if not torch.equal(row.bias, second.bias):
        wrong.append("row bias (replicated)")
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(5))
    if not torch.allclose(row(column(x)), second(first(x)), atol=1e-6):
        wrong.append("column then row differs from the unsplit layers")
    return wrong


def test_a_shard_is_the_slice_of_the_unsplit_weight_from_the_same_seed():
    for rank, wrong in enumerate(run_on_ranks(_shards, 3)):
        assert wrong == [], f"rank {rank}: {wrong}"
