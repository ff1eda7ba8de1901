"""Networks no one here wrote, held the way their authors hold them (``self.model = ...`` in
the LightningModule, Lightning's own demo ``LightningTransformer`` as it is), trained under
the model-parallel strategies and ``zero``'s three stages: the weights after k steps equal
one process's on the same global batch, the user's module keeps its type and parameter
names on every rank, and the checkpoint loads into the plain network.

Each (strategy, world size) is one launch of ``run_on_ranks`` (torchrun's path) running
every model in turn, so the matrix costs a few launches, not one per cell.
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
import torchvision
from _any_models import TinyGPT
from lightning.pytorch.demos import LightningTransformer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_par.comm import run_on_ranks
from lightning_par.pipeline.materialize import materialize
from lightning_par.strategies.gpipe import GPipeStrategy
from lightning_par.strategies.hybrid import HybridStrategy
from lightning_par.strategies.layerwise import LayerwiseStrategy
from lightning_par.strategies.tensor_parallel import TensorParallelStrategy
from lightning_par.strategies.zero import ZeroStrategy

BATCH, STEPS, VOCAB, SEQ = 6, 2, 40, 6


class SequenceNLL(nn.Module):
    """The demo Transformer's loss as a mean-reduced module (1F1B calls it per micro-batch)."""

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.nll_loss(output, target.reshape(-1))


class DemoTransformer(LightningTransformer):
    """Lightning's demo module as it is, plus the loss module the 1F1B schedule calls."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(vocab_size=VOCAB)
        self.criterion = SequenceNLL()
        # dropout draws its masks per micro-batch under a pipeline, per batch in one process:
        # the same weights need the same masks, so the comparison runs without it
        for module in self.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
            elif isinstance(module, nn.MultiheadAttention):
                module.dropout = 0.0

    def prepare_data(self) -> None:  # the demo downloads WikiText-2; synthetic tokens here
        pass

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(3)
        tokens = torch.randint(0, VOCAB, (BATCH * STEPS, SEQ), generator=g)
        return DataLoader(TensorDataset(tokens, tokens.roll(-1, dims=1)), batch_size=BATCH)


class Holder(pl.LightningModule):
    """A LightningModule holding someone else's network as ``self.model``."""

    def __init__(self, name: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.name = name
        if name == "tiny_gpt":
            self.model: nn.Module = TinyGPT(vocab=VOCAB, width=16, layers=2)
            self.criterion: nn.Module = TokenLoss()
        elif name == "one_linear":  # a linear classifier: no pair of layers to split
            self.model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 5))
            self.criterion = nn.CrossEntropyLoss()
        else:
            norm = None if name == "resnet18_bn" else (lambda c: nn.GroupNorm(4, c))
            self.model = torchvision.models.resnet18(num_classes=5, norm_layer=norm)
            self.criterion = nn.CrossEntropyLoss()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.criterion(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(3)
        n = BATCH * STEPS
        if self.name == "tiny_gpt":
            tokens = torch.randint(0, VOCAB, (n, SEQ), generator=g)
            return DataLoader(TensorDataset(tokens, tokens.roll(-1, dims=1)), batch_size=BATCH)
        x, y = torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 5, (n,), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=BATCH)


class TokenLoss(nn.Module):
    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def make(name: str) -> pl.LightningModule:
    return DemoTransformer() if name == "demo_transformer" else Holder(name)


def trainer(strategy, devices: int, epochs: int | None = None, precision: str = "32-true"):
    """``STEPS`` steps, or ``epochs`` whole epochs (of ``STEPS`` steps: checkpoints saved at
    an epoch's end resume at the next epoch's first batch)."""
    steps = STEPS if epochs is None else -1
    return pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=steps,
        max_epochs=epochs, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0, limit_val_batches=0,
        precision=precision,
    )  # fmt: skip


STRATEGIES = {
    "gpipe": lambda: GPipeStrategy(chunks=3),
    "1f1b": lambda: GPipeStrategy(chunks=3, schedule="1f1b"),
    "layerwise": lambda: LayerwiseStrategy(),
    "hybrid": lambda: HybridStrategy(dp=2, mp=2, mp_kind="gpipe", chunks=3),
    "tensor_parallel": lambda: TensorParallelStrategy(),
    "hybrid_tp": lambda: HybridStrategy(dp=2, mp=2, mp_kind="tensor_parallel"),
    # data parallel over the same batch on every rank: the mean of equal gradients
    "zero1": lambda: ZeroStrategy(stage=1),
    "zero2": lambda: ZeroStrategy(stage=2),
    "zero3": lambda: ZeroStrategy(stage=3),
}


def _train(rank: int, world: int, kind: str, names: list[str], tmp: str) -> dict:
    seen = {}
    for name in names:
        model = make(name)
        fit = trainer(STRATEGIES[kind](), world)
        fit.fit(model)
        held = sum(p.numel() for p in model.model.parameters())  # emptied: 0
        plan = getattr(fit.strategy.splitter, "tp_plan", None)
        assert plan is None or plan.cuts, "tensor_parallel split nothing"
        seen[name] = (type(model.model).__name__, [n for n, _ in model.model.named_parameters()],
                      held)  # fmt: skip
        fit.save_checkpoint(os.path.join(tmp, f"{kind}-{name}.ckpt"))
    return seen


_reference: dict[str, dict[str, torch.Tensor]] = {}


def one_process(name: str) -> dict[str, torch.Tensor]:
    if name not in _reference:
        model = make(name)
        trainer("auto", 1).fit(model)
        _reference[name] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return _reference[name]


CELLS = [
    ("gpipe", 2, ["resnet18_gn", "demo_transformer", "tiny_gpt"]),
    ("gpipe", 3, ["resnet18_gn", "tiny_gpt"]),
    ("1f1b", 2, ["resnet18_gn", "demo_transformer", "tiny_gpt"]),
    ("1f1b", 3, ["demo_transformer", "tiny_gpt"]),
    ("layerwise", 2, ["resnet18_bn", "demo_transformer", "tiny_gpt"]),
    ("layerwise", 3, ["resnet18_gn", "demo_transformer"]),
    ("hybrid", 4, ["resnet18_gn", "tiny_gpt"]),
    ("tensor_parallel", 2, ["resnet18_gn", "demo_transformer", "tiny_gpt"]),
    ("tensor_parallel", 3, ["resnet18_gn", "tiny_gpt"]),
    ("hybrid_tp", 4, ["resnet18_gn", "demo_transformer"]),
    ("zero1", 3, ["resnet18_bn", "tiny_gpt"]),
    ("zero2", 2, ["resnet18_gn", "demo_transformer"]),
    ("zero3", 2, ["resnet18_bn", "demo_transformer", "tiny_gpt"]),
    ("zero3", 3, ["resnet18_gn", "tiny_gpt"]),
]


@pytest.mark.parametrize("kind, world, names", CELLS, ids=[f"{k}-{w}" for k, w, _ in CELLS])
def test_any_network_trains_like_one_process(kind, world, names, tmp_path):
    seen = run_on_ranks(_train, world, kind, names, str(tmp_path), timeout=300)
    for name in names:
        plain = make(name)
        expected_names = [n for n, _ in plain.model.named_parameters()]
        for rank_seen in seen:  # the user's module, as the user built it, on every rank
            assert rank_seen[name][:2] == (type(plain.model).__name__, expected_names)
        if kind in ("gpipe", "1f1b", "layerwise"):  # each device holds its stages' weights
            total = sum(p.numel() for p in plain.model.parameters())
            held = [rank_seen[name][2] for rank_seen in seen]
            assert max(held) < total <= sum(held), (name, held, total)
        state = torch.load(tmp_path / f"{kind}-{name}.ckpt", weights_only=True)["state_dict"]
        plain.load_state_dict(state)  # the checkpoint loads without the strategy
        for key, value in one_process(name).items():
            torch.testing.assert_close(
                plain.state_dict()[key], value, rtol=1e-4, atol=2e-5, msg=f"{name}: {key}"
            )


def _resume(rank: int, world: int, kind: str, name: str, tmp: str) -> None:
    """Two steps under ``kind`` from the one-process checkpoint, then a checkpoint."""
    fit = trainer(STRATEGIES[kind](), world, epochs=2)
    fit.fit(make(name), ckpt_path=os.path.join(tmp, "one.ckpt"))
    fit.save_checkpoint(os.path.join(tmp, "resumed.ckpt"))


@pytest.mark.parametrize("kind, name", [("1f1b", "tiny_gpt"), ("gpipe", "resnet18_gn")])
def test_checkpoints_resume_across_the_pipeline_and_one_process(kind, name, tmp_path):
    """one process -> ``kind`` -> one process, each resuming the last's checkpoint (weights
    and momentum), ends where one process trained straight through ends."""
    straight = make(name)
    trainer("auto", 1, epochs=3).fit(straight)
    first = trainer("auto", 1, epochs=1)
    first.fit(make(name))
    first.save_checkpoint(tmp_path / "one.ckpt")
    run_on_ranks(_resume, 2, kind, name, str(tmp_path), timeout=300)
    last = make(name)
    trainer("auto", 1, epochs=3).fit(last, ckpt_path=tmp_path / "resumed.ckpt")
    for key, value in straight.state_dict().items():
        torch.testing.assert_close(last.state_dict()[key], value, rtol=1e-4, atol=2e-5, msg=key)


def test_tensor_parallel_refuses_in_the_ranks_a_network_it_cannot_split():
    """No layer pair to split: refused before the first step even where no launcher checked
    (torchrun's ranks), not trained replicated as a vacuous success."""
    with pytest.raises(Exception, match="tensor_parallel: nothing in `Holder.model` can be split"):
        run_on_ranks(_train, 2, "tensor_parallel", ["one_linear"], "", timeout=120)


def _built_on_meta(rank: int, world: int, tmp: str) -> int:
    fit = trainer(GPipeStrategy(chunks=3), world)
    with fit.init_module(empty_init=True):  # no memory: each device fills its own stages
        model = Holder("resnet18_gn")
    assert all(p.is_meta for p in model.parameters())
    fit.fit(model)
    fit.save_checkpoint(os.path.join(tmp, "meta.ckpt"))
    held = sum(p.numel() for p in model.model.parameters())
    # built on meta again, the checkpoint's weights land in each device's stages (not in
    # meta tensors before they have storage, then overwritten by a fresh initialisation)
    again = trainer(GPipeStrategy(chunks=3), world, epochs=1)
    with again.init_module(empty_init=True):
        model = Holder("resnet18_gn")
    again.fit(model, ckpt_path=os.path.join(tmp, "meta.ckpt"))  # already done: loads only
    again.save_checkpoint(os.path.join(tmp, "again.ckpt"))
    return held


def test_a_network_built_on_the_meta_device_is_materialised_stage_by_stage(tmp_path):
    held = run_on_ranks(_built_on_meta, 2, str(tmp_path), timeout=300)
    with torch.device("meta"):
        expected = Holder("resnet18_gn")
    materialize(expected.model)  # one process: every module, from the same seeds
    total = sum(p.numel() for p in expected.model.parameters())
    assert max(held) < total == sum(held)  # no device ever held the whole network
    trainer("auto", 1).fit(expected)
    state = torch.load(tmp_path / "meta.ckpt", weights_only=True)["state_dict"]
    for key, value in expected.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=2e-5, msg=key)
    again = torch.load(tmp_path / "again.ckpt", weights_only=True)["state_dict"]
    for key, value in state.items():
        torch.testing.assert_close(again[key], value, rtol=0, atol=0, msg=key)


def _meta_whole(rank: int, world: int, kind: str, precision: str, tmp: str) -> None:
    fit = trainer(kind, world, precision=precision)
    with torch.device("meta"):  # built without memory, as a user may build a large network
        model = Holder("resnet18_gn")
    fit.fit(model)
    fit.save_checkpoint(os.path.join(tmp, f"{kind}.ckpt"))


@pytest.mark.parametrize(
    "kind, precision",
    [("ring_allreduce", "32-true"), ("tensor_parallel", "32-true"), ("ring_allreduce", "64-true")],
)
def test_a_meta_network_is_materialised_whole_under_the_other_strategies(kind, precision, tmp_path):
    """Not only the pipelines: data-parallel and tensor-parallel ranks give a meta network
    storage as one process would (module by module, name-derived seeds, in the dtype it was
    built in, before a "-true" precision converts it), then train it."""
    run_on_ranks(_meta_whole, 2, kind, precision, str(tmp_path), timeout=300)
    with torch.device("meta"):
        expected = Holder("resnet18_gn")
    materialize(expected.model)
    trainer("auto", 1, precision=precision).fit(expected)
    state = torch.load(tmp_path / f"{kind}.ckpt", weights_only=True)["state_dict"]
    for key, value in expected.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=2e-5, msg=key)


def test_a_meta_network_that_cannot_be_initialised_stage_by_stage_is_refused():
    from _any_models import RawParameters

    with torch.device("meta"):
        model = RawParameters()
    with pytest.raises(ValueError, match="mm_param.* has no reset_parameters"):
        materialize(model, keep={"mm_param"})
