"""Which slice of a full tensor a rank holds: :class:`Shard`, and whole state dicts and
optimiser states cut into shards or put back together (for checkpoints that load without
the strategy, and resume from any plugin's checkpoint)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_par.split import even_sizes
from lightning_par.split import offsets as split_offsets


@dataclass(frozen=True)
class Shard:
    """Rank ``k`` holds ``sizes[k]`` consecutive rows along ``dim`` of each of ``groups``
    equal blocks of the full tensor (``groups=4``: an LSTM's gates ``i, f, g, o`` are four
    blocks of ``H`` rows each, and a rank keeps its hidden units' rows of every gate)."""

    dim: int
    sizes: tuple[int, ...]
    groups: int = 1

    @property
    def block(self) -> int:
        return sum(self.sizes)

    def take(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s part of ``full`` (a new contiguous tensor)."""
        blocks = full.chunk(self.groups, self.dim) if self.groups > 1 else (full,)
        start = split_offsets(self.sizes)[rank]
        parts = [b.narrow(self.dim, start, self.sizes[rank]) for b in blocks]
        return (
            torch.cat(parts, self.dim).contiguous()
            if len(parts) > 1
            else parts[0].clone(memory_format=torch.contiguous_format)
        )

    def assemble(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's part (in rank order)."""
        if self.groups == 1:
            return torch.cat(list(parts), self.dim)
        per_rank = [p.chunk(self.groups, self.dim) for p in parts]
        return torch.cat([piece[g] for g in range(self.groups) for piece in per_rank], self.dim)


def unit_sizes(units: int, world_size: int, unit: int = 1) -> tuple[int, ...]:
    """Near-equal sizes of ``units`` indivisible units of ``unit`` rows each (e.g. GroupNorm
    groups), per rank."""
    return tuple(n * unit for n in even_sizes(units, world_size))


def module_shards(module: torch.nn.Module) -> dict[str, Shard]:
    """Every split tensor of ``module`` (parameters and buffers), by state-dict name."""
    found = {}
    for prefix, sub in module.named_modules():
        for name, shard in getattr(sub, "tp_shards", {}).items():
            found[f"{prefix}.{name}" if prefix else name] = shard
    return found


def shard_state_dict(state: Mapping[str, Any], shards: Mapping[str, Shard], rank: int,
                     prefix: str = "") -> dict[str, Any]:  # fmt: skip
    """A full state dict cut to rank ``rank``'s parts (``shards`` keys under ``prefix``)."""
    out = dict(state)
    for name, shard in shards.items():
        key = prefix + name
        if key in out:
            out[key] = shard.take(out[key], rank)
    return out


def assemble_state_dict(states: Sequence[Mapping[str, Any]], shards: Mapping[str, Shard],
                        prefix: str = "") -> dict[str, Any]:  # fmt: skip
    """The full state dict from every rank's (rank order): split tensors assembled, the
    others (replicated, equal everywhere) taken from rank 0."""
    full = dict(states[0])
    for name, shard in shards.items():
        key = prefix + name
        if key in full:
            full[key] = shard.assemble([s[key] for s in states])
    return full


def parameter_shards(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> list[Shard | None]:
    """The :class:`Shard` (``None``: replicated) of each parameter in the order of the
    optimiser's state indices: ``optimizer``'s parameter groups, or without one
    ``module.parameters()`` (one group of every parameter)."""
    by_name = module_shards(module)
    by_id = {id(p): by_name.get(name) for name, p in module.named_parameters()}
    if optimizer is None:
        return list(by_id.values())
    return [by_id.get(id(p)) for group in optimizer.param_groups for p in group["params"]]


def _map_param_states(state: Mapping[str, Any], shards: Sequence[Shard | None], fn) -> dict:
    out = dict(state)
    per_param = {}
    index_to_shard = _indices(state, shards)
    for index, values in state["state"].items():
        shard = index_to_shard.get(index)
        per_param[index] = {k: fn(shard, k, v, index) for k, v in values.items()}
    out["state"] = per_param
    return out


def _indices(state: Mapping[str, Any], shards: Sequence[Shard | None]) -> dict[int, Shard | None]:
    order = [i for g in state["param_groups"] for i in g["params"]]
    if len(order) != len(shards):
        raise ValueError(
            f"tensor_parallel: the optimiser state has {len(order)} parameters but the "
            f"optimiser {len(shards)}: it was saved for another model or optimiser"
        )
    return {index: shard for index, shard in zip(order, shards)}


def shard_optimizer_state(state: Mapping[str, Any], shards: Sequence[Shard | None],
                          rank: int) -> dict:  # fmt: skip
    """A one-process optimiser state (``torch.optim.Optimizer.state_dict()``) cut to rank
    ``rank``: per-parameter tensors of the parameter's full shape (momentum, Adam's moments)
    are sliced like the parameter; scalars (``step``) are kept."""

    def cut(shard: Shard | None, key: str, value: Any, index: int) -> Any:
        if shard is None or not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        return shard.take(value, rank)

    return _map_param_states(state, shards, cut)


def assemble_optimizer_state(states: Sequence[Mapping[str, Any]],
                             shards: Sequence[Shard | None]) -> dict:  # fmt: skip
    """Every rank's optimiser state as one process's: the inverse of
    :func:`shard_optimizer_state`."""

    def join(shard: Shard | None, key: str, value: Any, index: int) -> Any:
        if shard is None or not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        return shard.assemble([s["state"][index][key] for s in states])

    return _map_param_states(states[0], shards, join)
