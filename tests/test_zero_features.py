"""``zero`` on what user models do: frozen, tied, unused and LightningModule-owned parameters,
weight decay on some groups only; stage 3 really holds only its shards between layers; an
optimizer that is not element-wise is refused by name."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par.comm import run_on_ranks
from lightning_par.launch.run import RankFailed
from lightning_par.strategies.zero import ZeroStrategy
from tests.test_zero_strategy import assert_same

STEPS, PER_RANK = 4, 3


class Awkward(pl.LightningModule):
    """Every kind of parameter a sharded step could get wrong."""

    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(12, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())  # applied twice
        self.head = nn.Linear(8, 12, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.unused = nn.Linear(8, 8)  # never in the graph: stays as it is
        self.scale = nn.Parameter(torch.ones(1))  # the LightningModule's own, in training_step
        self.optimizer = optimizer

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.frozen(self.embed(tokens).mean(1))
        return self.head(self.block(self.block(h)))

    def training_step(self, batch, batch_idx):
        tokens, target = batch
        return F.cross_entropy(self(tokens) * self.scale, target)

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in self.named_parameters() if not n.endswith("weight")]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        if self.optimizer == "lbfgs":
            return torch.optim.LBFGS(self.parameters())
        if self.optimizer == "mine":
            return MySGD(self.parameters(), lr=0.1)
        return torch.optim.AdamW(groups, lr=0.05)


class MySGD(torch.optim.SGD):
    """A user's own optimizer (element-wise, but zero cannot know)."""


def data(world_size: int):
    g = torch.Generator().manual_seed(7)
    n = STEPS * world_size * PER_RANK
    return torch.randint(0, 12, (n, 5), generator=g), torch.randint(0, 12, (n,), generator=g)


def trainer(strategy, devices: int, callbacks=()) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=STEPS,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, use_distributed_sampler=False,
                      callbacks=list(callbacks))  # fmt: skip


def weights(model: nn.Module) -> list:
    return [t.detach().numpy().copy() for t in model.state_dict().values()]


class ShardsOnly(pl.Callback):
    """Stage 3: between steps each rank holds only its shards (the LightningModule's own
    parameters aside, gathered for the whole step) and no whole gradient."""

    def __init__(self) -> None:
        self.checked = 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        shards = trainer.strategy.splitter
        resident = {id(p) for u in shards.stage3.resident for p in u.params}
        for unit in shards.units:
            if unit.params[0] is module.scale or id(unit.params[0]) in resident:
                continue
            assert not unit.gathered and unit.full.untyped_storage().nbytes() == 0, unit.index
            assert unit.shard.numel() == unit.shard_numel
        assert all(p.grad is None for p in module.parameters())
        self.checked += 1


def _fit(rank: int, world_size: int, stage: int, optimizer: str, declared=()) -> list:
    tokens, target = data(world_size)
    rows = torch.cat([torch.arange(s * world_size * PER_RANK + rank * PER_RANK,
                                   s * world_size * PER_RANK + (rank + 1) * PER_RANK)
                      for s in range(STEPS)])  # fmt: skip
    loader = DataLoader(TensorDataset(tokens[rows], target[rows]), batch_size=PER_RANK)
    model = Awkward(optimizer)
    check = ShardsOnly()
    callbacks = [check] if stage == 3 else []
    strategy = ZeroStrategy(stage=stage, elementwise_optimizers=declared)
    trainer(strategy, world_size, callbacks).fit(model, loader)
    assert stage != 3 or check.checked == STEPS
    return weights(model)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_frozen_tied_unused_and_own_parameters_like_one_process(stage):
    tokens, target = data(3)
    model = Awkward()
    untouched = weights(Awkward())
    trainer("auto", 1).fit(model, DataLoader(TensorDataset(tokens, target), batch_size=9))
    want = weights(model)
    results = run_on_ranks(_fit, 3, stage, "adamw", timeout=300)
    names = list(model.state_dict())
    for rank, got in enumerate(results):
        assert_same(got, want, False, f"stage {stage}, rank {rank}")
    for name, before, after in zip(names, untouched, results[0]):
        if name.startswith(("frozen", "unused")):  # no gradient: AdamW skips them
            assert (before == after).all(), name


def test_an_optimizer_that_is_not_element_wise_is_refused_by_name():
    with pytest.raises(RankFailed) as err:
        run_on_ranks(_fit, 2, 2, "lbfgs", timeout=120)
    assert "LBFGS is not" in str(err.value) and "element-wise" in str(err.value)


def test_a_users_own_optimizer_is_refused_until_declared_element_wise():
    with pytest.raises(RankFailed) as err:
        run_on_ranks(_fit, 2, 1, "mine", timeout=120)
    assert "elementwise_optimizers=[MySGD]" in str(err.value)
    declared = run_on_ranks(_fit, 2, 1, "mine", (MySGD,), timeout=120)
    assert all((a == b).all() for a, b in zip(declared[0], declared[1]))


def test_bad_options_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="stage must be 1"):
        ZeroStrategy(stage=4)
    with pytest.raises(TypeError, match="optimizer classes"):
        ZeroStrategy(elementwise_optimizers=["SGD"])
    with pytest.raises(ValueError, match="bucket_cap_mb must be > 0"):
        ZeroStrategy(bucket_cap_mb=0)


class GatheredAtOnce(pl.Callback):
    """Stage 3: how many units are gathered while each layer runs, after the first step (which
    keeps all of them to learn the order)."""

    def __init__(self) -> None:
        self.most = 0
        self.hooks = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        shards = trainer.strategy.splitter
        if batch_idx == 1:
            for layer in module.modules():
                self.hooks.append(layer.register_forward_hook(lambda *a: self.count(shards)))
            for p in module.parameters():  # during backward, as each gradient is done
                if p.requires_grad:
                    self.hooks.append(
                        p.register_post_accumulate_grad_hook(lambda *a: self.count(shards))
                    )

    def count(self, shards) -> None:
        self.most = max(self.most, sum(u.gathered for u in shards.units))

    def on_train_end(self, trainer, module):
        for hook in self.hooks:
            hook.remove()


def _peak(rank: int, world_size: int) -> tuple[int, int]:
    from lightning_par.models import CifarCNN

    torch.manual_seed(0)
    model = CifarCNN(width=8, num_blocks=2, scheduler=None)
    x, y = torch.randn(12, 3, 32, 32), torch.randint(0, 10, (12,))
    peak = GatheredAtOnce()
    trainer(ZeroStrategy(stage=3), world_size, [peak]).fit(
        model, DataLoader(TensorDataset(x, y), batch_size=4)
    )
    return peak.most, len(trainer_units(model))


def trainer_units(model) -> list:
    return [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]


def test_stage_three_gathers_a_layer_at_a_time_and_the_next_one_ahead():
    """Each layer's unit is gathered for its forward (with the next one prefetched) and again
    for its backward, and freed after: a handful at once, not the whole model."""
    (most, units), _ = run_on_ranks(_peak, 2, timeout=120)
    assert units >= 10 and most <= 3, (most, units)
