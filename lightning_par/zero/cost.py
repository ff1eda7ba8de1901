"""What ZeRO costs one rank: the bytes it holds and the bytes it sends per step, by stage.

**Memory** (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC 2020, arXiv:1910.02054, section 5.1 and figure 1). Plain data
parallelism (stage 0 here, ``ring_allreduce``) keeps on every rank ``Ψ`` parameters, their
``Ψ`` gradients and the optimizer's state: with Adam in fp32 ``4Ψ + 4Ψ + 8Ψ`` bytes (the
paper's mixed-precision count is ``2Ψ + 2Ψ + 12Ψ``). Each stage divides by ``p`` the terms
it shards: stage 1 the state, stage 2 the gradients too, stage 3 the parameters too
(:func:`formula`). The exact count (:func:`held`) follows the flat units
(:class:`~lightning_par.zero.units.FlatUnit`):

* **padding**: a unit of ``n`` elements is padded to ``p S`` with ``S = ceil(n / p)``;
  stages 1-2 keep the whole padded buffer (``p S`` elements, up to ``p - 1`` more than
  ``n``), stage 3 and the gradient shards of stages 2-3 ``S`` per unit; the optimizer
  steps only real elements (:class:`~lightning_par.zero.units.Piece`), so the last ranks
  may hold a little less state than the first;
* **scalars**: state that is not shaped like a parameter (Adam's ``step``: 4 bytes) counts
  once per piece, i.e. per parameter a rank holds a slice of (:func:`state_layout`);
* **flags**: the gradients travel with one "has a gradient" element per parameter (in
  ``ring_allreduce``'s buckets, in the rows stage 2-3 reduce-scatter); stages 0-1 keep
  those buckets between steps (:attr:`Held.buffers`: ``numel + flags`` elements each, a
  second copy of the gradients as DDP keeps without ``gradient_as_bucket_view``); stages
  2-3 build their rows during backward and drop them after.

**Messages** per rank and step (:func:`sent`), from the collectives' cost models
(:func:`~lightning_par.collectives.cost_model.ring_cost`,
:func:`~lightning_par.collectives.cost_model.reduce_scatter_cost`,
:func:`~lightning_par.collectives.cost_model.all_gather_cost`: ``p - 1`` chunks per phase,
one message per segment of a chunk):

* stage 0: ``ring_allreduce`` of each bucket (``2 (p - 1)`` chunks);
* stage 1: the same, plus one all-gather of each trainable unit's ``p S`` new weights;
* stage 2: one reduce-scatter per trainable unit of ``p`` rows of ``S + F`` (``F`` flags,
  one per parameter of the unit) and the same all-gathers;
* stage 3: each unit all-gathered before its layer's forward and again before its
  backward, a unit that no module's forward covers ("resident") once per step, and the
  stage 2 reduce-scatters; the first step gathers every unit once (it records which module
  uses which unit) and nothing again before backward.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_par.collectives.cost_model import (
    Cost,
    all_gather_cost,
    reduce_scatter_cost,
    ring_cost,
)
from lightning_par.collectives.ring import DEFAULT_SEGMENT_BYTES
from lightning_par.zero.units import FlatUnit, group_parameters, unit_parameters

#: 0 is plain data parallelism (``ring_allreduce``), the paper's baseline.
STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class UnitSize:
    """What the cost of one flat unit depends on: its parameters' sizes, which of them
    train, and its element type."""

    numels: tuple[int, ...]
    trainable: tuple[bool, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def flags(self) -> int:
        """``F``: one "has a gradient" flag per parameter."""
        return len(self.numels)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def trains(self) -> bool:
        return any(self.trainable)

    def shard_numel(self, p: int) -> int:
        """``S = ceil(n / p)``, as :class:`~lightning_par.zero.units.FlatUnit`."""
        return -(-self.numel // p)

    def padded_numel(self, p: int) -> int:
        return self.shard_numel(p) * p

    def pieces(self, p: int, rank: int) -> list[tuple[int, int]]:
        """``(parameter index, elements)`` of each piece in ``rank``'s shard
        (:meth:`FlatUnit.pieces_of <lightning_par.zero.units.FlatUnit.pieces_of>`)."""
        s = self.shard_numel(p)
        lo, hi, start, out = rank * s, (rank + 1) * s, 0, []
        for i, n in enumerate(self.numels):
            overlap = min(hi, start + n) - max(lo, start)
            if overlap > 0:
                out.append((i, overlap))
            start += n
        return out


def size_of(params: list[nn.Parameter]) -> UnitSize:
    return UnitSize(tuple(q.numel() for q in params), tuple(q.requires_grad for q in params),
                    params[0].dtype)  # fmt: skip


def sizes_of(units: Iterable[FlatUnit]) -> tuple[UnitSize, ...]:
    """The sizes of live units (a strategy's ``splitter.units``)."""
    return tuple(size_of(u.params) for u in units)


@dataclass(frozen=True)
class Layout:
    """One stage's units, ``ring_allreduce``'s gradient buckets (stages 0-1) and the units
    stage 3 gathers once per step (``resident``: indices into ``units``)."""

    stage: int
    units: tuple[UnitSize, ...]
    buckets: tuple[UnitSize, ...] = ()
    resident: frozenset[int] = field(default_factory=frozenset)

    @property
    def psi(self) -> int:
        """``Ψ``: trainable parameter elements."""
        return sum(n for u in self.units for n, t in zip(u.numels, u.trainable) if t)


def layout(model: nn.Module, stage: int, bucket_cap_mb: float = 4.0) -> Layout:
    """``model``'s :class:`Layout` at ``stage``. Stage 3's resident units are taken to be
    those of the root module's own parameters (used in ``training_step``); a module whose
    forward never runs makes its units resident too: replace ``resident`` with the live
    :attr:`StageThree.resident <lightning_par.zero.gather.StageThree.resident>` then."""
    if stage not in STAGES:
        raise ValueError(f"zero cost: stage must be one of {STAGES}, got {stage!r}")
    groups = unit_parameters(model, stage, bucket_cap_mb)
    buckets: tuple[UnitSize, ...] = ()
    if stage <= 1:
        trainable = [q for q in model.parameters() if q.requires_grad]
        cap = int(bucket_cap_mb * 2**20)
        buckets = tuple(size_of(g) for g in group_parameters(list(reversed(trainable)), cap))
    own = {id(q) for q in model.parameters(recurse=False)}
    resident = frozenset(
        i for i, g in enumerate(groups) if stage == 3 and any(id(q) in own for q in g)
    )
    return Layout(stage, tuple(size_of(g) for g in groups), buckets, resident)


# ---- memory ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class StateLayout:
    """What an optimizer keeps per parameter: ``shaped`` tensors like it, and
    ``scalar_bytes`` of tensors that are not (Adam's ``step``)."""

    shaped: int
    scalar_bytes: int


#: torch's Adam and AdamW in fp32: ``exp_avg``, ``exp_avg_sq`` and a float32 ``step``.
ADAM = StateLayout(shaped=2, scalar_bytes=4)


def state_layout(optimizer_cls: type, dtype: torch.dtype = torch.float32, **options) -> StateLayout:
    """The :class:`StateLayout` of ``optimizer_cls(params, **options)``, from one step on
    a two-element parameter (so ``SGD`` without momentum keeps nothing, with it one tensor)."""
    probe = nn.Parameter(torch.zeros(2, dtype=dtype))
    probe.grad = torch.ones(2, dtype=dtype)
    optimizer = optimizer_cls([probe], **options)
    optimizer.step()
    shaped = scalar = 0
    for value in optimizer.state[probe].values():
        if isinstance(value, torch.Tensor) and value.shape == probe.shape:
            shaped += 1
        elif isinstance(value, torch.Tensor):
            scalar += value.numel() * value.element_size()
    return StateLayout(shaped, scalar)


@dataclass(frozen=True)
class Held:
    """Bytes one rank holds: the model states (``params + grads + optimizer``, the paper's
    terms) and, apart, communication buffers kept between steps."""

    params: float
    grads: float
    optimizer: float
    buffers: float = 0

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer


def formula(psi: int, stage: int, p: int, param_bytes: float = 4, grad_bytes: float = 4,
            state_bytes: float = 8) -> Held:  # fmt: skip
    """The paper's bytes per rank (figure 1): ``Ψ`` parameters of ``param_bytes`` each,
    gradients of ``grad_bytes``, optimizer state of ``state_bytes`` per parameter (Adam in
    fp32: 4, 4, 8; the paper's mixed precision: 2, 2, 12), each divided by ``p`` from the
    stage that shards it on (state 1, gradients 2, parameters 3)."""
    if stage not in STAGES:
        raise ValueError(f"zero cost: stage must be one of {STAGES}, got {stage!r}")
    return Held(
        psi * param_bytes / (p if stage >= 3 else 1),
        psi * grad_bytes / (p if stage >= 2 else 1),
        psi * state_bytes / (p if stage >= 1 else 1),
    )


def held(plan: Layout, p: int, rank: int, state: StateLayout = ADAM) -> Held:
    """The exact bytes ``rank`` holds after backward, as the strategy lays them out (see the
    module: padding, scalars, buckets); every trainable parameter has a gradient."""
    params = grads = optimizer = 0
    for u in plan.units:
        es, s = u.element_size, u.shard_numel(p)
        if plan.stage == 0:
            params += u.numel * es
        else:
            params += (s if plan.stage == 3 else u.padded_numel(p)) * es
        # the elements this rank steps: whole parameters (stage 0) or its pieces
        mine = list(enumerate(u.numels)) if plan.stage == 0 else u.pieces(p, rank)
        if plan.stage <= 1:  # whole gradients
            grads += sum(n for n, t in zip(u.numels, u.trainable) if t) * es
        elif any(u.trainable[i] for i, _ in mine):  # the unit's shard of the summed rows
            grads += s * es
        for i, n in mine:
            if u.trainable[i]:
                optimizer += state.shaped * n * es + state.scalar_bytes
    buffers = sum((b.numel + b.flags) * b.element_size for b in plan.buckets) if p > 1 else 0
    return Held(params, grads, optimizer, buffers)


# ---- messages ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sent:
    """Bytes and messages one rank sends."""

    bytes: int = 0
    messages: int = 0

    def __add__(self, other: Sent) -> Sent:
        return Sent(self.bytes + other.bytes, self.messages + other.messages)

    def times(self, k: int) -> Sent:
        return Sent(self.bytes * k, self.messages * k)


def sent(plan: Layout, p: int, rank: int, first_step: bool = False,
         segment_bytes: int | None = DEFAULT_SEGMENT_BYTES) -> Sent:  # fmt: skip
    """What ``rank`` sends in one optimizer step (no accumulation), ``first_step``: stage
    3's first, which gathers every unit once. Stage 3's units are taken to be used by one
    forward each whose output needs a gradient (so their backward runs and gathers them
    again)."""

    def mine(cost: Cost) -> Sent:
        return Sent(cost.bytes_sent[rank], cost.messages_sent[rank])

    total = Sent()
    for b in plan.buckets:
        total += mine(ring_cost(b.numel + b.flags, p, b.element_size, segment_bytes))
    for i, u in enumerate(plan.units):
        es = u.element_size
        gather = mine(all_gather_cost(u.padded_numel(p), p, es, segment_bytes))
        rows = p * (u.shard_numel(p) + u.flags)
        if plan.stage in (1, 2) and u.trains:
            total += gather
        if plan.stage >= 2 and u.trains:
            total += mine(reduce_scatter_cost(rows, p, es, segment_bytes))
        if plan.stage == 3:
            total += gather.times(1 if first_step or i in plan.resident else 2)
    return total


def resident_of(units: Collection[FlatUnit], resident: Iterable[FlatUnit]) -> frozenset[int]:
    """Positions in ``units`` of the live ``resident`` ones (for :class:`Layout`)."""
    where = {id(u): n for n, u in enumerate(units)}
    return frozenset(where[id(u)] for u in resident)
