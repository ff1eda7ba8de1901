"""ZeRO's cost model (``lightning_par.zero.cost``) against the paper's figure, the live
units' tensors and the trace of real fits.

The fits run ``ring_allreduce`` (stage 0) and ``zero`` at stages 1-3 on two and three
ranks, on a CNN and on a model with odd sizes (padding on three ranks) and a parameter used
in ``training_step`` itself (a resident unit at stage 3). Every step's bytes and messages
of every rank must equal :func:`~lightning_par.zero.cost.sent` (stage 3's first step
gathers every unit once), and the bytes held after backward, counted from the units'
buffers and shards, the pieces' gradients, the optimizer's state and the gradient buckets,
must equal :func:`~lightning_par.zero.cost.held`.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par.comm import run_on_ranks
from lightning_par.models import CifarCNN
from lightning_par.strategies.allreduce import AllReduceStrategy
from lightning_par.strategies.zero import ZeroStrategy
from lightning_par.zero.cost import (
    ADAM,
    STAGES,
    Held,
    StateLayout,
    formula,
    held,
    layout,
    resident_of,
    sent,
    sizes_of,
    state_layout,
)
from lightning_par.zero.units import FlatUnit, unit_parameters
from tests.test_allreduce_strategies import trainer

STEPS = 3  # the first (stage 3 gathers everything), a steady one, and the one measured


class Tempered(pl.LightningModule):
    """Odd sizes (13 * 7 + 7 + 7 * 5 + 5 + 1 = 139 elements) and a temperature used in
    ``training_step``, outside any module's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(13, 7), nn.ReLU(), nn.Linear(7, 5))
        self.temperature = nn.Parameter(torch.ones(1))

    @override
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x) / self.temperature, y)

    @override
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def make(kind: str) -> pl.LightningModule:
    torch.manual_seed(0)
    if kind == "cnn":
        return CifarCNN(width=4, num_blocks=1, optimizer="adam", scheduler=None, lr=1e-3)
    return Tempered()


def data(kind: str, rank: int) -> DataLoader:
    g = torch.Generator().manual_seed(rank)
    shape = (3, 32, 32) if kind == "cnn" else (13,)
    n = 4 * STEPS
    x = torch.randn(n, *shape, generator=g)
    y = torch.randint(0, 10 if kind == "cnn" else 5, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4)


def storage_bytes(tensors) -> int:
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                for t in tensors if t is not None}  # fmt: skip
    return sum(storages.values())


class Record(pl.Callback):
    """Each step's (bytes, messages) sent; after the last backward the bytes held,
    counted from the strategy's own objects; the live units' layout."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, int]] = []
        self.held: Held | None = None
        self.plan = None
        self._mark = 0

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._mark = len(trainer.strategy.trace.messages)

    @override
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step != STEPS - 1:
            return
        strategy = trainer.strategy
        splitter = strategy.splitter if isinstance(strategy, ZeroStrategy) else None
        sync = strategy.grad_sync if splitter is None else splitter.grad_sync
        buckets = [b.buffer for b in sync.buckets.buckets] if sync is not None else []
        state = [v for s in optimizer.state.values() for v in s.values()]
        if splitter is None:  # ring_allreduce: whole parameters
            params = list(pl_module.parameters())
            grads = [q.grad for q in params]
        else:
            params = [t for u in splitter.units for t in (u.full, u.shard)]
            pieces = [q for s in splitter.sharded.values() for q in s.piece_parameters()]
            grads = [q.grad for q in [*pieces, *pl_module.parameters()]]
        self.held = Held(storage_bytes(params), storage_bytes(grads), storage_bytes(state),
                         storage_bytes(buckets))  # fmt: skip

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        sends = [m for m in trainer.strategy.trace.messages[self._mark :] if m.op == "send"]
        self.sent.append((sum(m.nbytes for m in sends), len(sends)))
        if self.plan is None and isinstance(trainer.strategy, ZeroStrategy):
            splitter = trainer.strategy.splitter
            resident = splitter.stage3.resident if splitter.stage3 is not None else []
            self.plan = (sizes_of(splitter.units), resident_of(splitter.units, resident))


def _fits(rank: int, world: int) -> dict:
    out = {}
    for kind in ("cnn", "tempered"):
        for stage in STAGES:
            model, record = make(kind), Record()
            plan = layout(make(kind), stage)
            if stage:
                strategy = ZeroStrategy(stage=stage, trace=True)
            else:
                strategy = AllReduceStrategy("ring", trace=True)
            trainer(strategy, world, max_steps=STEPS, callbacks=[record]).fit(
                model, data(kind, rank)
            )
            out[kind, stage] = {"plan": plan, "live": record.plan, "sent": record.sent,
                                "held": record.held}  # fmt: skip
    return out


@pytest.fixture(scope="module", params=[2, 3])
def fits(request):
    world = request.param
    return world, run_on_ranks(_fits, world, timeout=300)


@pytest.mark.parametrize("kind", ["cnn", "tempered"])
def test_bytes_and_messages_of_every_step_are_the_models(fits, kind):
    world, results = fits
    for stage in STAGES:
        for rank, result in enumerate(results):
            run = result[kind, stage]
            plan = run["plan"]
            if run["live"] is not None:  # the cost model lays the units out as zero does
                assert (plan.units, plan.resident) == run["live"], f"stage {stage} layout"
            for step, got in enumerate(run["sent"]):
                want = sent(plan, world, rank, first_step=step == 0)
                assert got == (want.bytes, want.messages), (
                    f"{kind}, stage {stage}, rank {rank}, step {step}: sent {got}, "
                    f"model {(want.bytes, want.messages)}"
                )


@pytest.mark.parametrize("kind", ["cnn", "tempered"])
def test_bytes_held_are_the_models(fits, kind):
    world, results = fits
    for stage in STAGES:
        for rank, result in enumerate(results):
            run = result[kind, stage]
            want = held(run["plan"], world, rank)
            assert run["held"] == want, f"{kind}, stage {stage}, rank {rank}"
            # ... above the paper's formula by no more than the padding (under p elements
            # per unit, in each of the three terms) and Adam's 4-byte step, one per piece
            plan = run["plan"]
            paper = formula(plan.psi, stage, world).model_states
            pieces = sum(u.flags for u in plan.units) + len(plan.units)
            slack = 3 * 4 * (world - 1) * len(plan.units) + 4 * pieces
            assert 0 <= run["held"].model_states - paper <= slack


def test_the_formula_gives_the_papers_figure_1():
    """7.5 B parameters, 64 GPUs, mixed-precision Adam (K = 12): 120, 31.4, 16.6, 1.9 GB."""
    got = [formula(7_500_000_000, stage, 64, 2, 2, 12).model_states / 1e9 for stage in STAGES]
    assert got == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.05)


def test_state_layout_is_read_from_the_optimizer():
    assert state_layout(torch.optim.Adam) == ADAM == state_layout(torch.optim.AdamW)
    assert state_layout(torch.optim.SGD, lr=0.1) == StateLayout(0, 0)
    assert state_layout(torch.optim.SGD, lr=0.1, momentum=0.9) == StateLayout(1, 0)
    assert state_layout(torch.optim.Adagrad) == StateLayout(1, 4)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_unit_sizes_pad_and_cut_as_flat_units_do(world):
    """Padding, shards and pieces of the arithmetic against FlatUnit's, every rank."""
    for stage in (1, 3):
        plan = layout(make("tempered"), stage, bucket_cap_mb=1e-4)
        for rank in range(world):
            groups = unit_parameters(make("tempered"), stage, 1e-4)
            for size, group in zip(plan.units, groups, strict=True):
                unit = FlatUnit(0, group, world, rank)
                assert size.shard_numel(world) == unit.shard_numel
                assert size.padded_numel(world) == unit.padded_numel == unit.full.numel()
                assert size.pieces(world, rank) == [(pc.index, pc.numel) for pc in unit.pieces]
