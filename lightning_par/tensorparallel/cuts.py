"""What a tensor-parallel cut is, and when a column -> row pair can be cut exactly."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_par.tensorparallel.shard import unit_sizes

STYLES = ("column", "row", "column_gather", "lstm", "heads", "vocab")
#: Modules that act on each feature/channel alone: safe between a column and a row layer.
ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Identity)
NORMS = (nn.GroupNorm, _BatchNorm)
WEIGHT_LAYERS = (nn.Linear, nn.Conv2d)
#: Why a layer whose parameters another place of the model uses too stays whole: a cut
#: replaces the layer at one name only, so the other place would keep the old weights and
#: the two would train apart (and a checkpoint hold both)
SHARED = (
    "its weights are used at another place too (tied, or the same layer applied twice); a "
    "cut would replace it at one place only and untie them"
)


@dataclass(frozen=True)
class Cut:
    """One module to replace: ``style`` is a plan style or ``"norm"``; ``sizes`` the split
    dimension's length on each rank."""

    name: str
    style: str
    sizes: tuple[int, ...]
    #: the split dimension of a ``"dropout"`` cut's activation (-1: features, 1: channels)
    dim: int = -1


@dataclass
class Plan:
    """A resolved plan for ``world_size`` ranks: the cuts, and why each weight layer left
    out stays replicated."""

    world_size: int
    cuts: list[Cut] = field(default_factory=list)
    replicated: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        lines = [f"{c.name}: {c.style} {list(c.sizes)}" for c in self.cuts]
        lines += [f"{name}: replicated ({why})" for name, why in self.replicated.items()]
        return "\n".join(lines)


def _features(layer: nn.Module, side: str) -> int:
    if isinstance(layer, nn.Linear):
        return layer.out_features if side == "out" else layer.in_features
    return layer.out_channels if side == "out" else layer.in_channels


def _between(children: list[tuple[str, nn.Module]], i: int) -> int:
    """Index of the first module after ``i`` that is not elementwise, a norm or dropout."""
    j = i + 1
    while j < len(children) and isinstance(children[j][1], ELEMENTWISE + NORMS + (nn.Dropout,)):
        j += 1
    return j


def between_cuts(
    named: list[tuple[str, nn.Module]], first: nn.Module, sizes: tuple[int, ...]
) -> list[Cut]:
    """The norms and dropouts between a column and a row layer, cut with them."""
    dim = -1 if isinstance(first, nn.Linear) else 1
    return [
        Cut(name, "norm" if isinstance(m, NORMS) else "dropout", sizes, dim)
        for name, m in named
        if isinstance(m, NORMS + (nn.Dropout,))
    ]


def _conv_reason(conv: nn.Conv2d) -> str:
    if conv.groups != 1 or conv.padding_mode != "zeros":
        return f"a convolution with groups={conv.groups}, {conv.padding_mode} padding"
    return ""


def pair_sizes(first: nn.Module, norms: list[nn.Module], second: nn.Module, p: int
               ) -> tuple[tuple[int, ...] | None, str]:  # fmt: skip
    """Per-rank sizes of the features a column -> row pair splits, or ``None`` and why not."""
    for layer in (first, second):
        if isinstance(layer, nn.Conv2d) and _conv_reason(layer):
            return None, _conv_reason(layer)
    features = _features(first, "out")
    if features != _features(second, "in"):
        return None, f"{features} outputs feed {_features(second, 'in')} inputs"
    unit = 1
    for norm in norms:
        if isinstance(norm, nn.GroupNorm):
            unit = math.lcm(unit, norm.num_channels // norm.num_groups)
    if features // unit < p:
        what = f"{features // unit} GroupNorm groups" if unit > 1 else f"{features} features"
        return None, f"{what} cannot be split over {p} ranks"
    return unit_sizes(features // unit, p, unit), ""


def tied_parameters(module: nn.Module) -> set[int]:
    """The ids of the parameters of ``module`` reached under more than one name: tied
    weights, and every parameter of a layer that appears at two places."""
    counts: dict[int, int] = {}
    for _, parameter in module.named_parameters(remove_duplicate=False):
        counts[id(parameter)] = counts.get(id(parameter), 0) + 1
    return {key for key, count in counts.items() if count > 1}


def shares(module: nn.Module, tied: set[int]) -> bool:
    """Whether any parameter of ``module`` is one of ``tied`` (:data:`SHARED`)."""
    return any(id(p) in tied for p in module.parameters())


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
