"""tensor_parallel on a network whose layer pairs live in its ``forward`` (torchvision's
ResNet: ``conv1 -> bn1 -> relu -> conv2`` is no ``nn.Sequential``) and a LightningModule
with no ``example_input_array``: the ranks trace what the user's step passes the network on
the first batch, cut the pairs as they would with the array set, and train to one process's
weights; reading that batch leaves the user's shuffle as one process's. Also
``distributed_sampler_kwargs`` (Lightning's convention): one replica for a model split
over the ranks, the data-parallel size and rank under ``hybrid``."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from _split_models import trainer as _trainer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchvision.models.resnet import BasicBlock, ResNet

from lightning_par.strategies.gpipe import GPipeStrategy
from lightning_par.strategies.hybrid import HybridStrategy
from lightning_par.strategies.layerwise import LayerwiseStrategy
from lightning_par.strategies.tensor_parallel import TensorParallelStrategy
from lightning_par.tensorparallel import resolve_plan

NORMS = {"group": lambda c: nn.GroupNorm(2, c), "batch": None}


class HeldResNet(pl.LightningModule):
    """A user's module holding torchvision's ResNet (one BasicBlock per stage) as
    ``self.model``, with no ``example_input_array``."""

    def __init__(self, norm: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=4, norm_layer=NORMS[norm])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (for an example_input_array)
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _shuffled_images() -> DataLoader:
    """Shuffled by the loader's own seeded generator, which iterating advances."""
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(24, 3, 16, 16, generator=g), torch.randint(0, 4, (24,), generator=g)
    )
    return DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(2))


class InRank(pl.Callback):
    """Checks in rank 0 of the run: the plan cut is ``expected`` (the one the network's trace
    on an example gives) and every rank reads the whole batch."""

    def __init__(self, expected: str) -> None:
        self.expected = expected

    def on_train_start(self, trainer, pl_module) -> None:
        assert trainer.strategy.splitter.tp_plan.describe() == self.expected
        assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}


def _split_fit(model: pl.LightningModule, expected: str) -> dict[str, torch.Tensor]:
    _trainer(TensorParallelStrategy(), 2, callbacks=[InRank(expected)]).fit(
        model, _shuffled_images()
    )
    return model.state_dict()


@pytest.mark.parametrize("norm", ["group", "batch"])
def test_resnet_without_example_input_array_splits_and_trains_like_one_process(norm):
    model = HeldResNet(norm)
    reference, with_array = copy.deepcopy(model), copy.deepcopy(model)
    with_array.example_input_array = torch.zeros(2, 3, 16, 16)
    expected = resolve_plan(model, 2, None, "model", (with_array.example_input_array,))
    assert any(c.name == "model.layer1.0.conv1" and c.style == "column" for c in expected.cuts)
    assert "example_input_array" in resolve_plan(model, 2, None, "model").describe()
    _trainer("auto", 1).fit(reference, _shuffled_images())
    got = _split_fit(model, expected.describe())
    # BatchNorm over 8 values at 1x1 (layer4) amplifies rounding: there, what matters is
    # the very weights the example_input_array gives, and one process's within rounding
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if norm == "group" else {"rtol": 0, "atol": 5e-3}
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(got[key], value, **tolerance, msg=lambda m, k=key: f"{k}: {m}")
    if norm == "batch":
        for key, value in _split_fit(with_array, expected.describe()).items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)


def test_a_network_with_nothing_to_cut_is_still_refused_before_launch():
    class OneLinear(HeldResNet):
        def __init__(self) -> None:
            pl.LightningModule.__init__(self)
            self.model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 4))

    with pytest.raises(ValueError, match="nothing in `OneLinear.model` can be split"):
        _trainer(TensorParallelStrategy(), 2).fit(OneLinear(), _shuffled_images())


# ---- distributed_sampler_kwargs ------------------------------------------------------------------
@pytest.mark.parametrize(
    "make", [GPipeStrategy, LayerwiseStrategy, TensorParallelStrategy],
    ids=["gpipe", "layerwise", "tensor_parallel"],
)  # fmt: skip
def test_a_model_split_over_the_ranks_is_one_data_replica(make):
    trainer = _trainer(make(), 2)
    for rank in (0, 1):
        trainer.strategy.cluster_environment.set_global_rank(rank)
        assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}


def test_hybrid_reports_the_data_parallel_size_and_rank():
    trainer = _trainer(HybridStrategy(dp=2, mp=2), 4)
    for rank, replica in enumerate([0, 0, 1, 1]):  # model-parallel ranks are consecutive
        trainer.strategy.cluster_environment.set_global_rank(rank)
        assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": replica}


class ShardsItsOwnLoader(pl.LightningModule):
    """A user's module that shards its loader by Lightning's convention itself."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(3)
        data = TensorDataset(
            torch.randn(24, 8, generator=g), torch.randint(0, 3, (24,), generator=g)
        )
        kwargs = (
            self.trainer.strategy.distributed_sampler_kwargs
            if self.trainer.world_size > 1
            else {"num_replicas": 1, "rank": 0}
        )
        return DataLoader(
            data, batch_size=6, sampler=DistributedSampler(data, shuffle=False, **kwargs)
        )


def test_a_loader_sharded_by_the_kwargs_trains_like_one_process():
    model, reference = ShardsItsOwnLoader(), ShardsItsOwnLoader()
    _trainer("auto", 1, use_distributed_sampler=False).fit(reference)
    _trainer(TensorParallelStrategy(), 2, use_distributed_sampler=False).fit(model)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=1e-5, atol=1e-6, msg=key)
