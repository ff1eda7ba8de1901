"""Tensor-parallel layers: each rank holds a slice of a layer's weight (Megatron-LM,
Shoeybi et al., 2019, arXiv:1909.08053; the course's "vertical slicing" of a layer).

* :class:`ColumnParallelLinear` / :class:`ColumnParallelConv2d`: output features (channels)
  split; the whole input enters through ``f``; the output stays split (or is gathered);
* :class:`RowParallelLinear` / :class:`RowParallelConv2d`: input features (channels) split;
  the partial outputs are summed by ``g``, then the bias is added once;
* :func:`split_norm`: a GroupNorm (whole groups) or BatchNorm between the two, per channel;
* :class:`ParallelLSTM`: the hidden units split; every time step all-gathers the hidden
  state (each rank's gates need all of it).

A column layer followed by a row layer (with activations and split norms between) is
Megatron's MLP block: one allreduce forward (``g``) and one backward (``f``), however wide
the hidden layer. Every layer keeps the parameter names of the module it replaces, and
``tp_shards`` says how each of its tensors is cut (:mod:`.shard`), so state dicts and
optimiser states convert to and from one process's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lightning_par.tensorparallel.mappings import (
    TPGroup,
    copy_to,
    gather_from,
    gather_recurrent,
    reduce_from,
    split_to,
)
from lightning_par.tensorparallel.shard import Shard


def _param(full: torch.Tensor | None, shard: Shard | None, rank: int) -> nn.Parameter | None:
    if full is None:
        return None
    data = shard.take(full.detach(), rank) if shard is not None else full.detach().clone()
    return nn.Parameter(data, requires_grad=full.requires_grad)


class _Parallel(nn.Module):
    """What every split layer has: its group, the per-rank sizes of the split dimension,
    and ``tp_shards`` (state-dict name -> :class:`Shard`)."""

    def __init__(self, group: TPGroup, sizes: Sequence[int]) -> None:
        super().__init__()
        self.group, self.sizes = group, tuple(sizes)
        self.tp_shards: dict[str, Shard] = {}

    def _take(self, name: str, full: torch.Tensor | None, shard: Shard | None) -> None:
        if full is not None and shard is not None:
            self.tp_shards[name] = shard
        self.register_parameter(name, _param(full, shard, self.group.rank))

    def extra_repr(self) -> str:
        return f"rank={self.group.rank}, sizes={list(self.sizes)}"


class ColumnParallelLinear(_Parallel):
    """``nn.Linear`` with its output features split: rank ``k`` computes ``sizes[k]`` of them.

    Args:
        linear: the full layer (its weights are copied; every rank must pass the same).
        group: the ranks it is split over.
        sizes: output features per rank (sum = ``out_features``).
        gather_output: all-gather the output (replicated); else it stays split (for a
            :class:`RowParallelLinear` next).
    """

    def __init__(self, linear: nn.Linear, group: TPGroup, sizes: Sequence[int],
                 gather_output: bool = False) -> None:  # fmt: skip
        super().__init__(group, sizes)
        self.gather_output = gather_output
        self._take("weight", linear.weight, Shard(0, self.sizes))
        self._take("bias", linear.bias, Shard(0, self.sizes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to(x, self.group), self.weight, self.bias)
        return gather_from(y, self.group, self.sizes, -1) if self.gather_output else y


class RowParallelLinear(_Parallel):
    """``nn.Linear`` with its input features split; ``g`` sums the partial outputs and the
    (replicated) bias is added once, after the sum.

    Args:
        input_is_parallel: the input arrives split (from a column layer); else each rank
            takes its slice of a replicated input.
    """

    def __init__(self, linear: nn.Linear, group: TPGroup, sizes: Sequence[int],
                 input_is_parallel: bool = True) -> None:  # fmt: skip
        super().__init__(group, sizes)
        self.input_is_parallel = input_is_parallel
        self._take("weight", linear.weight, Shard(1, self.sizes))
        self._take("bias", linear.bias, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = split_to(x, self.group, self.sizes, -1)
        y = reduce_from(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


def _conv_settings(conv: nn.Conv2d) -> dict:
    if conv.groups != 1 or conv.padding_mode != "zeros":
        raise ValueError(
            f"tensor_parallel splits only plain convolutions (groups=1, zero padding), got "
            f"groups={conv.groups}, padding_mode={conv.padding_mode!r}"
        )
    return {"stride": conv.stride, "padding": conv.padding, "dilation": conv.dilation}


class ColumnParallelConv2d(_Parallel):
    """``nn.Conv2d`` with its output channels split: rank ``k`` computes ``sizes[k]``
    feature maps from all the input channels (the course's "partial connectivity" cut)."""

    def __init__(self, conv: nn.Conv2d, group: TPGroup, sizes: Sequence[int],
                 gather_output: bool = False) -> None:  # fmt: skip
        super().__init__(group, sizes)
        self.settings, self.gather_output = _conv_settings(conv), gather_output
        self._take("weight", conv.weight, Shard(0, self.sizes))
        self._take("bias", conv.bias, Shard(0, self.sizes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.conv2d(copy_to(x, self.group), self.weight, self.bias, **self.settings)
        return gather_from(y, self.group, self.sizes, 1) if self.gather_output else y


class RowParallelConv2d(_Parallel):
    """``nn.Conv2d`` with its input channels split: each rank convolves its channels into
    all the output maps, ``g`` sums them, the bias is added once."""

    def __init__(self, conv: nn.Conv2d, group: TPGroup, sizes: Sequence[int]) -> None:
        super().__init__(group, sizes)
        self.settings = _conv_settings(conv)
        self._take("weight", conv.weight, Shard(1, self.sizes))
        self._take("bias", conv.bias, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from(F.conv2d(x, self.weight, None, **self.settings), self.group)
        return y + self.bias.view(1, -1, 1, 1) if self.bias is not None else y


def split_norm(norm: nn.Module, group: TPGroup, sizes: Sequence[int]) -> nn.Module:
    """A per-channel norm on this rank's channels: a GroupNorm keeps whole groups (``sizes``
    must be multiples of the channels per group), a BatchNorm its channels' statistics."""
    rank, shard = group.rank, Shard(0, tuple(sizes))
    local = sizes[rank]
    if isinstance(norm, nn.GroupNorm):
        per_group = norm.num_channels // norm.num_groups
        if any(s % per_group for s in sizes):
            raise ValueError(f"channel split {list(sizes)} cuts a GroupNorm group of {per_group}")
        new: nn.Module = nn.GroupNorm(local // per_group, local, norm.eps, norm.affine)
    elif isinstance(norm, nn.modules.batchnorm._BatchNorm):
        new = type(norm)(local, norm.eps, norm.momentum, norm.affine, norm.track_running_stats)
    else:
        raise TypeError(f"cannot split {type(norm).__name__} by channels")
    like = next((t for t in norm.state_dict().values() if t.is_floating_point()), None)
    if like is not None:  # the original's device and dtype (float64 models stay float64)
        new = new.to(device=like.device, dtype=like.dtype)
    shards = {}
    with torch.no_grad():
        for name, tensor in norm.state_dict().items():
            if tensor.dim() == 1 and tensor.shape[0] == sum(sizes):
                shards[name] = shard
                new.state_dict()[name].copy_(shard.take(tensor, rank))
            else:
                new.state_dict()[name].copy_(tensor)
    new.tp_shards = shards
    return new


class ParallelLSTM(_Parallel):
    """A one-layer ``nn.LSTM`` with its hidden units split: rank ``k`` computes units
    ``sizes[k]`` of every gate (``i, f, g, o``) and their cell states.

    The input projection of all time steps is one matrix product (input through ``f``);
    each step then needs the whole previous hidden state, so it is all-gathered every time
    step (:func:`~.mappings.gather_recurrent`; backward: a reduce-scatter per step). The
    output sequence is replicated. Returns ``(output, (h_n, c_n))`` like ``nn.LSTM``, with
    ``h_n`` whole and ``c_n`` this rank's units, each ``[1, B, ...]``.
    """

    def __init__(self, lstm: nn.LSTM, group: TPGroup, sizes: Sequence[int]) -> None:
        if lstm.num_layers != 1 or lstm.bidirectional or lstm.proj_size:
            raise ValueError("tensor_parallel splits one-layer, one-direction LSTMs without proj")
        super().__init__(group, sizes)
        self.batch_first, self.hidden_size = lstm.batch_first, lstm.hidden_size
        gates = Shard(0, self.sizes, groups=4)
        for name in ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0"):
            self._take(name, getattr(lstm, name, None), gates)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None = None):
        if state is not None:
            raise ValueError("ParallelLSTM starts from a zero state (no state argument)")
        if not self.batch_first:
            x = x.transpose(0, 1)
        group, sizes = self.group, self.sizes
        inputs = F.linear(copy_to(x, group), self.weight_ih_l0, self.bias_ih_l0)
        batch = x.shape[0]
        h = x.new_zeros(batch, self.hidden_size)
        c = x.new_zeros(batch, sizes[group.rank])
        outputs = []
        for t in range(x.shape[1]):
            gates = inputs[:, t] + F.linear(h, self.weight_hh_l0, self.bias_hh_l0)
            i, f, g, o = gates.chunk(4, dim=1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h_local = torch.sigmoid(o) * torch.tanh(c)
            h, out = gather_recurrent(h_local, group, sizes, 1)
            outputs.append(out)
        y = torch.stack(outputs, 1)
        if not self.batch_first:
            y = y.transpose(0, 1)
        return y, (outputs[-1].unsqueeze(0), c.unsqueeze(0))
