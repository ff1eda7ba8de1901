"""Networks as Lightning users write them, under the pipelines (issue #37):

* the schedules past GPipe (1F1B, interleaved, zero bubble) with the strategy's ``loss_fn``
  and ``target_index`` instead of a ``module.criterion``, on networks no one here wrote
  (torchvision's MLP and ResNet-18, Lightning's demo Transformer), batches ``(index, x, y)``;
* Lightning's demo ``SimpleLSTM``, whose ``hidden`` argument holds the batch in dimension 1
  and whose output is ``(output, (h, c))``: micro-batched along each tensor's own batch
  dimension, its ``(h, c)`` travelling between stages as two tensors;
* the refusals, before launch, naming the strategy and the fix.

Each comparison is one launch of ``run_on_ranks`` running every cell in turn; the weights
after ``STEPS`` steps, what ``training_step`` saw and the logged loss equal one process's.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torchvision
from lightning.pytorch.demos import SimpleLSTM, Transformer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_par.comm import run_on_ranks
from lightning_par.strategies.gpipe import GPipeStrategy
from lightning_par.strategies.hybrid import HybridStrategy
from lightning_par.strategies.layerwise import LayerwiseStrategy

BATCH, STEPS, VOCAB, SEQ = 8, 2, 12, 5
TOL = {"rtol": 1e-4, "atol": 2e-5}


class Indexed(Dataset):
    """Samples ``(index, x, y)``: the target is not the batch's second element."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


def lstm_loss(output, target: torch.Tensor) -> torch.Tensor:
    """SimpleLSTM's ``(log-probabilities, (h, c))`` against the next tokens, plus a term on
    the returned ``h`` (so its gradient, cut along its batch dimension 1, counts)."""
    log_probs, (h, _) = output
    return F.nll_loss(log_probs, target.reshape(-1)) + 0.1 * h.pow(2).mean()


def token_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.nll_loss(output, target.reshape(-1))  # the demo Transformer's log-probabilities


class Holder(pl.LightningModule):
    """Someone else's network as ``self.model``; the loss computed in ``training_step``."""

    def __init__(self, name: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.name, self.seen = name, []
        g = torch.Generator().manual_seed(1)
        n = BATCH * STEPS
        if name == "mlp":
            self.model: nn.Module = torchvision.ops.MLP(16, [32, 32, 4])
            x, y = torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)
            self.data = Indexed(x, y)
        elif name == "resnet":
            gn = lambda c: nn.GroupNorm(4, c)  # noqa: E731
            self.model = torchvision.models.resnet18(num_classes=4, norm_layer=gn)
            x, y = torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 4, (n,), generator=g)
            self.data = Indexed(x, y)
        else:
            if name == "lstm":
                self.model = SimpleLSTM(vocab_size=VOCAB, ninp=8, nhid=16, nlayers=2, dropout=0.0)
            else:
                self.model = Transformer(vocab_size=VOCAB, ninp=16, nhead=2, nhid=16, nlayers=2,
                                         dropout=0.0)  # fmt: skip
            tokens = torch.randint(0, VOCAB, (n, SEQ), generator=g)
            self.data = Indexed(tokens, tokens.roll(-1, dims=1))

    def forward(self, x: torch.Tensor):
        if self.name == "lstm":  # the demo's own call: a hidden state sized by the batch
            return self.model(x, self.model.init_hidden(x.size(0)))
        if self.name == "transformer":
            return self.model(x, x)
        return self.model(x)

    def training_step(self, batch, batch_idx):
        _, x, y = batch
        out = self(x)
        if self.name == "lstm":
            self.seen.append([out[0].detach().clone(), *(h.detach().clone() for h in out[1])])
            loss = lstm_loss(out, y)
        elif self.name == "transformer":
            loss = token_loss(out, y)
        else:
            loss = F.cross_entropy(out, y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=BATCH)


def _trainer(strategy, devices: int) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip


CELLS = {  # name -> (network, strategy)
    "mlp-zero_bubble": ("mlp", lambda: GPipeStrategy(
        chunks=2, schedule="zero_bubble", loss_fn=nn.CrossEntropyLoss(), target_index=2)),
    "resnet-interleaved": ("resnet", lambda: GPipeStrategy(
        chunks=2, schedule="interleaved", loss_fn=nn.CrossEntropyLoss(), target_index=2)),
    "transformer-1f1b": ("transformer", lambda: GPipeStrategy(
        chunks=4, schedule="1f1b", loss_fn=token_loss, target_index=2)),
    "lstm-gpipe-2": ("lstm", lambda: GPipeStrategy(chunks=2)),
    "lstm-gpipe-4": ("lstm", lambda: GPipeStrategy(chunks=4)),
    "lstm-layerwise": ("lstm", lambda: LayerwiseStrategy()),
    "lstm-hybrid-1f1b": ("lstm", lambda: HybridStrategy(
        dp=1, mp=2, chunks=4, schedule="1f1b", loss_fn=lstm_loss, target_index=2)),
}  # fmt: skip


def _train(rank: int, world: int, cells: list[str]) -> dict:
    out = {}
    for cell in cells:
        name, strategy = CELLS[cell]
        model = Holder(name)
        fit = _trainer(strategy(), world)
        fit.fit(model)
        out[cell] = (fit.strategy.lightning_module_state_dict(), model.seen,
                     float(fit.callback_metrics["train_loss"]))  # fmt: skip
    return out


def _one_process(name: str) -> tuple[dict, list, float]:
    model = Holder(name)
    fit = _trainer("auto", 1)
    fit.fit(model)
    return model.state_dict(), model.seen, float(fit.callback_metrics["train_loss"])


@pytest.mark.parametrize(
    "cells",
    [
        ["mlp-zero_bubble", "resnet-interleaved", "transformer-1f1b"],
        ["lstm-gpipe-2", "lstm-gpipe-4", "lstm-layerwise", "lstm-hybrid-1f1b"],
    ],
    ids=["loss_fn", "lstm"],
)
def test_trains_like_one_process(cells):
    ranks = run_on_ranks(_train, 2, cells, timeout=300)
    for cell in cells:
        expected, seen, loss = _one_process(CELLS[cell][0])
        state = ranks[0][cell][0]  # the full model, gathered on rank 0
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, **TOL, msg=f"{cell}: {key}")
        for rank in ranks:  # every rank's training_step saw one process's values
            assert rank[cell][2] == pytest.approx(loss, rel=1e-5), cell
            for got, want in zip(rank[cell][1], seen, strict=True):
                for a, b in zip(got, want, strict=True):
                    torch.testing.assert_close(a, b, **TOL, msg=cell)


def test_a_schedule_past_gpipe_without_a_loss_is_refused_before_launch():
    fit = _trainer(GPipeStrategy(chunks=2, schedule="1f1b"), 2)
    with pytest.raises(TypeError) as refused:
        fit.fit(Holder("mlp"))
    message = str(refused.value)
    assert "gpipe(schedule='1f1b') computes the loss per micro-batch" in message
    assert "loss_fn=nn.CrossEntropyLoss()" in message and "`module.criterion`" in message
    assert "raised on rank" not in message  # the main process's own check, no rank started
    with pytest.raises(TypeError, match="loss_fn must be a callable"):
        GPipeStrategy(schedule="1f1b", loss_fn="cross_entropy")


class Attention(nn.Module):
    """``nn.MultiheadAttention`` returns ``(output, None)`` without weights: the tuple, kept
    whole across a cut before ``mix``, holds a value that cannot travel."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        both = self.attn(x, x, x, need_weights=False)
        return self.head(self.mix(x) + both[0]).mean(1)


class AttentionHolder(Holder):
    def __init__(self) -> None:
        super().__init__("mlp")
        self.model = Attention()
        g = torch.Generator().manual_seed(1)
        self.data = Indexed(torch.randn(8, 3, 16, generator=g), torch.randint(0, 4, (8,)))


def test_a_value_that_cannot_travel_is_refused_before_launch():
    fit = _trainer(LayerwiseStrategy(split_points=["mix"]), 2)
    with pytest.raises(ValueError) as refused:
        fit.fit(AttentionHolder())
    message = str(refused.value)
    assert "layerwise cannot split Attention" in message
    assert "'attn' (tuple(Tensor, NoneType)" in message and "split_points=[...]" in message
    assert "raised on rank" not in message
