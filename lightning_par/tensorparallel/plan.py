"""Which layers are cut how, and cutting them: :func:`resolve_plan` and :func:`parallelize`.

A plan maps module names (as in ``module.named_modules()``) to a style, like torch's
``parallelize_module``:

* ``"column"``: output features/channels split; the next weight layer of the same
  ``nn.Sequential`` (only activations and per-channel norms between) must be ``"row"``;
  the norms between are split with it (GroupNorm by whole groups);
* ``"row"``: input features/channels split, the partial outputs summed (``g``);
* ``"column_gather"``: output split and all-gathered (a layer on its own);
* ``"lstm"``: a one-layer ``nn.LSTM`` with its hidden units split (a gather per time step).

Everything not in the plan is replicated: every rank computes it whole on the same
(replicated) activations, so it gets the same gradient everywhere and needs no messages.

The automatic plan (no plan given) walks ``module.<root>`` (``net``): in every
``nn.Sequential``, two ``nn.Linear`` (or two ``nn.Conv2d``) in a row, with only activations
and per-channel norms between, become a column -> row pair (Megatron's MLP block); every
one-layer LSTM is split by hidden units. A layer whose weights another place of the model
uses too (tied, or one layer applied twice) stays whole: a cut replaces it at one name only.
On :class:`~lightning_par.models.CifarCNN` that is the two convolutions of each residual
block (the stem, the skip projections and the head stay replicated); on
:class:`~lightning_par.models.CifarRNN` every LSTM layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch.distributed as dist
from torch import nn

from lightning_par.comm import Communicator
from lightning_par.graphcut import UnsplittableModel
from lightning_par.tensorparallel.attention import ParallelMultiheadAttention
from lightning_par.tensorparallel.blocks import EXPECTED, auto_block, user_block
from lightning_par.tensorparallel.cuts import (
    NORMS,
    SHARED,
    STYLES,
    WEIGHT_LAYERS,
    Cut,
    Plan,
    _between,
    _conv_reason,
    _features,
    between_cuts,
    join,
    pair_sizes,
    shares,
    tied_parameters,
)
from lightning_par.tensorparallel.embedding import ShardedDropout, VocabParallelEmbedding
from lightning_par.tensorparallel.layers import (
    ColumnParallelConv2d,
    ColumnParallelLinear,
    ParallelLSTM,
    RowParallelConv2d,
    RowParallelLinear,
    split_norm,
)
from lightning_par.tensorparallel.mappings import TPGroup
from lightning_par.tensorparallel.shard import unit_sizes
from lightning_par.tensorparallel.traced import traced_pairs

#: Why a weight layer outside any ``nn.Sequential`` stays whole when no example was traced
#: (``tensor_parallel`` traces the first batch in the ranks: see ``TensorParallelSplit``).
UNTRACED = (
    "not in an nn.Sequential, so its consumer is unknown (give the module an "
    "example_input_array to trace it)"
)

#: A traced column layer's partner: ((name, module) between, (name, module) of the row).
TracedPair = tuple[list[tuple[str, nn.Module]], tuple[str, nn.Module]]


def _lstm_reason(lstm: nn.LSTM, p: int) -> str:
    if lstm.num_layers != 1 or lstm.bidirectional or lstm.proj_size:
        return "only one-layer, one-direction LSTMs without proj_size are split"
    if lstm.hidden_size < p:
        return f"{lstm.hidden_size} hidden units cannot be split over {p} ranks"
    return ""


def _auto(module: nn.Module, prefix: str, p: int, plan: Plan, tied: set[int],
          traced: dict[str, TracedPair] | None = None) -> None:  # fmt: skip
    if auto_block(module, prefix, p, plan, tied):
        return
    if isinstance(module, nn.LSTM):
        why = SHARED if shares(module, tied) else _lstm_reason(module, p)
        if why:
            plan.replicated[prefix] = why
        else:
            plan.cuts.append(Cut(prefix, "lstm", unit_sizes(module.hidden_size, p)))
        return
    children = list(module.named_children())
    i = 0
    while i < len(children):
        name, child = children[i]
        full = join(prefix, name)
        if not isinstance(child, WEIGHT_LAYERS):
            _auto(child, full, p, plan, tied, traced)
            i += 1
            continue
        j = _between(children, i)
        if shares(child, tied):  # (the row of a traced pair never is: see _traced_pair)
            plan.replicated[full] = SHARED
        elif not isinstance(module, nn.Sequential):
            if any(c.name == full for c in plan.cuts):  # the row of a traced pair
                i += 1
                continue
            if traced is not None and full in traced:
                _traced_pair(child, full, traced[full], p, plan, tied)
            else:
                why = "the trace finds no layer of its kind fed only by it" if traced else UNTRACED
                plan.replicated[full] = why
        elif j < len(children) and type(children[j][1]) is type(child):
            norms = [m for _, m in children[i + 1 : j] if isinstance(m, NORMS)]
            sizes, why = pair_sizes(child, norms, children[j][1], p)
            if any(shares(m, tied) for _, m in children[i + 1 : j + 1]):
                sizes, why = None, f"the layer after it, {join(prefix, children[j][0])}: {SHARED}"
            if sizes is not None:
                plan.cuts.append(Cut(full, "column", sizes))
                named = [(join(prefix, n), m) for n, m in children[i + 1 : j]]
                plan.cuts += between_cuts(named, child, sizes)
                plan.cuts.append(Cut(join(prefix, children[j][0]), "row", sizes))
                i = j + 1
                continue
            plan.replicated[full] = why
        else:
            plan.replicated[full] = "no layer of its kind right after it to pair with"
        i += 1


def _traced_pair(first: nn.Module, full: str, pair: TracedPair, p: int, plan: Plan,
                 tied: set[int]) -> None:  # fmt: skip
    """Cut the column -> row pair the trace found from ``full``."""
    between, (row, second) = pair
    norms = [m for _, m in between if isinstance(m, NORMS)]
    sizes, why = pair_sizes(first, norms, second, p)
    if any(shares(m, tied) for _, m in [*between, (row, second)]):
        sizes, why = None, f"the layer it feeds, {row}: {SHARED}"
    if sizes is None:
        plan.replicated[full] = why
        return
    plan.cuts.append(Cut(full, "column", sizes))
    plan.cuts += between_cuts(between, first, sizes)
    plan.cuts.append(Cut(row, "row", sizes))


def _user(module: nn.Module, styles: Mapping[str, str], p: int) -> Plan:
    plan = Plan(p)
    modules = dict(module.named_modules())
    paired_rows = set()
    for name, style in styles.items():
        if name not in modules:
            raise ValueError(f"tensor_parallel plan: no module named {name!r} in the model")
        if style not in STYLES:
            raise ValueError(
                f"tensor_parallel plan: {name!r}: style {style!r} is not one of {STYLES}"
            )
        layer = modules[name]
        expected, what = EXPECTED.get(style, (WEIGHT_LAYERS, "an nn.Linear or nn.Conv2d"))
        if not isinstance(layer, expected):
            raise ValueError(
                f"tensor_parallel plan: {name!r} is a {type(layer).__name__}; style {style!r} "
                f"splits {what}"
            )
        if style in ("heads", "vocab"):
            plan.cuts.append(user_block(name, layer, style, p))
        elif style == "lstm":
            why = _lstm_reason(layer, p)
            if why:
                raise ValueError(f"tensor_parallel plan: {name!r}: {why}")
            plan.cuts.append(Cut(name, style, unit_sizes(layer.hidden_size, p)))
        elif style == "column_gather":
            features = _features(layer, "out")
            why = _conv_reason(layer) if isinstance(layer, nn.Conv2d) else ""
            if why or features < p:
                why = why or f"{features} features cannot be split over {p} ranks"
                raise ValueError(f"tensor_parallel plan: {name!r}: {why}")
            plan.cuts.append(Cut(name, style, unit_sizes(features, p)))
        elif style == "column":
            parent_name, _, own = name.rpartition(".")
            parent = modules[parent_name]
            children = list(parent.named_children()) if isinstance(parent, nn.Sequential) else []
            index = [n for n, _ in children].index(own) if children else -1
            j = _between(children, index) if children else 0
            row = join(parent_name, children[j][0]) if 0 <= index and j < len(children) else None
            if row is None or styles.get(row) != "row":
                raise ValueError(
                    f"tensor_parallel plan: column layer {name!r} must be followed, in its "
                    "nn.Sequential, by a 'row' layer (only activations and norms between)"
                )
            named = [(join(parent_name, n), m) for n, m in children[index + 1 : j]]
            norms = [m for _, m in named if isinstance(m, NORMS)]
            sizes, why = pair_sizes(layer, norms, children[j][1], p)
            if sizes is None:
                raise ValueError(f"tensor_parallel plan: {name!r} -> {row!r}: {why}")
            plan.cuts.append(Cut(name, "column", sizes))
            plan.cuts += between_cuts(named, layer, sizes)
            plan.cuts.append(Cut(row, "row", sizes))
            paired_rows.add(row)
    for name, style in styles.items():
        if style == "row" and name not in paired_rows:
            raise ValueError(
                f"tensor_parallel plan: row layer {name!r} needs a 'column' layer right before "
                "it in the same nn.Sequential"
            )
    tied = tied_parameters(module)
    for cut in plan.cuts:
        if shares(modules[cut.name], tied):
            raise ValueError(
                f"tensor_parallel plan: {cut.name!r}: {SHARED}; leave it out of the plan"
            )
    return plan


def resolve_plan(module: nn.Module, world_size: int, plan: Mapping[str, str] | None = None,
                 root: str = "net", example_inputs: Sequence | None = None) -> Plan:  # fmt: skip
    """The cuts for ``world_size`` ranks: ``plan`` (names relative to ``module``) checked,
    or the automatic plan of ``module.<root>`` (``module`` itself if it has no ``root``).
    Raises ``ValueError`` naming the layer for a plan that cannot run exactly."""
    if plan is not None:
        return _user(module, plan, world_size)
    resolved = Plan(world_size)
    start = getattr(module, root, None) if root else None
    tied = tied_parameters(module)
    net = start if isinstance(start, nn.Module) else module
    prefix = root if isinstance(start, nn.Module) else ""
    traced = None
    if example_inputs is not None:  # pairs outside any nn.Sequential, from the graph
        layers = dict(net.named_modules())
        try:
            found = traced_pairs(net, example_inputs)
        except UnsplittableModel:  # no graph: the pairs inside nn.Sequentials only
            found = {}
        traced = {
            join(prefix, column): (
                [(join(prefix, b), layers[b]) for b in between],
                (join(prefix, row), layers[row]),
            )
            for column, (between, row) in found.items()
        }
    _auto(net, prefix, world_size, resolved, tied, traced)
    return resolved


def _build(cut: Cut, old: nn.Module, group: TPGroup) -> nn.Module:
    conv = isinstance(old, nn.Conv2d)
    if cut.style == "column":
        return (ColumnParallelConv2d if conv else ColumnParallelLinear)(old, group, cut.sizes)
    if cut.style == "column_gather":
        return (ColumnParallelConv2d if conv else ColumnParallelLinear)(
            old, group, cut.sizes, gather_output=True
        )
    if cut.style == "row":
        return (RowParallelConv2d if conv else RowParallelLinear)(old, group, cut.sizes)
    if cut.style == "norm":
        return split_norm(old, group, cut.sizes)
    if cut.style == "dropout":
        return ShardedDropout(old, group, cut.sizes, cut.dim)
    if cut.style == "heads":
        return ParallelMultiheadAttention(old, group, cut.sizes)
    if cut.style == "vocab":
        return VocabParallelEmbedding(old, group, cut.sizes)
    return ParallelLSTM(old, group, cut.sizes)


def as_group(group: TPGroup | Communicator | dist.ProcessGroup | None, algorithm: str = "ring"
             ) -> TPGroup:  # fmt: skip
    if isinstance(group, TPGroup):
        return group
    comm = group if isinstance(group, Communicator) else Communicator(group)
    return TPGroup(comm, algorithm)


def parallelize(module: nn.Module, group: TPGroup | Communicator | dist.ProcessGroup | None = None,
                plan: Plan | Mapping[str, str] | None = None, *, root: str = "net",
                algorithm: str = "ring") -> Plan:  # fmt: skip
    """Replace ``module``'s layers by their tensor-parallel versions, in place, over the ranks
    of ``group`` (a process group, a :class:`~lightning_par.comm.Communicator` or a
    :class:`~.mappings.TPGroup`; ``None``: the default group). Every rank must call it with
    the same full weights (each keeps its slice). Returns the resolved :class:`Plan`."""
    tp = as_group(group, algorithm)
    if not isinstance(plan, Plan):
        plan = resolve_plan(module, tp.world_size, plan, root)
    for cut in plan.cuts:
        parent_name, _, own = cut.name.rpartition(".")
        parent = module.get_submodule(parent_name)
        setattr(parent, own, _build(cut, getattr(parent, own), tp))
    return plan
