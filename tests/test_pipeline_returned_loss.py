"""The schedules past GPipe train ``loss_fn``'s gradients, so a ``training_step`` returning
another loss (an L2 term, label smoothing, a weight) is refused at its first step, on every
rank, naming both values and the fix; the same loss (with gradient accumulation, under
bf16-mixed, with the fix applied) still trains like one process.

The cells run in one launch of ``run_on_ranks`` (each rank returns its error message or its
weights); one refusal also runs through a plain ``Trainer.fit``, as a user's script does."""

from __future__ import annotations

import re

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_par.comm import run_on_ranks
from lightning_par.strategies.gpipe import GPipeStrategy
from lightning_par.strategies.hybrid import HybridStrategy

BATCH, STEPS = 8, 2
FIX = "Pass loss_fn equal to what training_step returns"


def half_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The cross entropy returned in bfloat16 (a loss computed in 16 bits)."""
    return F.cross_entropy(output, target).to(torch.bfloat16)


class Classifier(pl.LightningModule):
    """Four layers with weights (interleaved: 2 devices x 2 stages); ``variant`` picks the loss that
    ``training_step`` returns: the cross entropy (``"same"``) or another loss."""

    def __init__(self, variant: str = "same", manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.variant = variant
        self.automatic_optimization = not manual
        self.example_input_array = torch.zeros(2, 8)
        act = lambda i, o: nn.Sequential(nn.Tanh(), nn.Linear(i, o))  # noqa: E731
        self.net = nn.Sequential(nn.Linear(8, 16), act(16, 16), act(16, 16), act(16, 4))
        g = torch.Generator().manual_seed(1)
        n = BATCH * STEPS * 2  # two optimiser steps even with accumulate_grad_batches=2
        self.data = TensorDataset(3 * torch.randn(n, 8, generator=g),
                                  torch.randint(0, 4, (n,), generator=g))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(self._loss(batch))
            optimizer.step()
            return None
        return self._loss(batch)

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        out = self(x)
        smoothing = 0.1 if self.variant == "smoothing" else 0.0
        loss = F.cross_entropy(out, y, label_smoothing=smoothing)
        if self.variant == "l2":
            loss = loss + 0.01 * sum(p.pow(2).sum() for p in self.parameters())
        if self.variant == "weighted":
            loss = 2.0 * loss
        if self.variant == "half":
            loss = half_loss(out, y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=BATCH)


def _trainer(strategy, devices: int, **kw) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0, limit_val_batches=0, **kw,
    )  # fmt: skip


CE = nn.CrossEntropyLoss
CELLS = {  # name -> (variant, strategy, trainer options)
    # refused: training_step returns another loss than loss_fn
    "l2-1f1b": ("l2", lambda: GPipeStrategy(chunks=2, schedule="1f1b", loss_fn=CE()), {}),
    "smoothing-zero_bubble": ("smoothing", lambda: GPipeStrategy(
        chunks=2, schedule="zero_bubble", loss_fn=CE()), {}),
    "weighted-interleaved": ("weighted", lambda: GPipeStrategy(
        chunks=2, schedule="interleaved", loss_fn=CE()), {}),
    "l2-hybrid-1f1b": ("l2", lambda: HybridStrategy(
        dp=1, mp=2, chunks=2, schedule="1f1b", loss_fn=CE()), {}),
    "weighted-accumulate": ("weighted", lambda: GPipeStrategy(
        chunks=2, schedule="1f1b", loss_fn=CE()), {"accumulate_grad_batches": 2}),
    "smoothing-bf16": ("smoothing", lambda: GPipeStrategy(
        chunks=2, schedule="interleaved", loss_fn=CE()), {"precision": "bf16-mixed"}),
    "weighted-manual": ("weighted-manual", lambda: GPipeStrategy(
        chunks=2, schedule="1f1b", loss_fn=CE()), {}),
    "weighted-half": ("weighted", lambda: GPipeStrategy(
        chunks=2, schedule="interleaved", loss_fn=half_loss), {"precision": "bf16-mixed"}),
    # accepted: the same loss
    "same-accumulate": ("same", lambda: GPipeStrategy(
        chunks=2, schedule="1f1b", loss_fn=CE()), {"accumulate_grad_batches": 2}),
    "same-manual": ("same-manual", lambda: GPipeStrategy(
        chunks=2, schedule="1f1b", loss_fn=CE()), {}),
    "same-bf16": ("same", lambda: GPipeStrategy(
        chunks=2, schedule="interleaved", loss_fn=CE()), {"precision": "bf16-mixed"}),
    "half-bf16": ("half", lambda: GPipeStrategy(
        chunks=2, schedule="interleaved", loss_fn=half_loss), {"precision": "bf16-mixed"}),
    "smoothing-fixed": ("smoothing", lambda: GPipeStrategy(
        chunks=2, schedule="zero_bubble", loss_fn=CE(label_smoothing=0.1)), {}),
}  # fmt: skip


def _train(rank: int, world: int, cells: list[str]) -> dict:
    out = {}
    for cell in cells:
        variant, strategy, options = CELLS[cell]
        model = _model(variant)
        fit = _trainer(strategy(), world, **options)
        try:
            fit.fit(model)
        except ValueError as error:
            out[cell] = str(error)
            continue
        out[cell] = (fit.strategy.lightning_module_state_dict(), fit.global_step)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_on_ranks(_train, 2, list(CELLS), timeout=300)


def _model(variant: str) -> Classifier:
    """``"<loss>"`` or ``"<loss>-manual"`` (manual optimisation)."""
    loss, _, manual = variant.partition("-")
    return Classifier(loss, manual=manual == "manual")


def _one_process(variant: str, **options) -> pl.LightningModule:
    model = _model(variant)
    _trainer("auto", 1, **options).fit(model)
    return model


def _first_loss(variant: str = "same") -> float:
    """The cross entropy of the first batch under the initial weights."""
    model = Classifier(variant)
    x, y = model.data[:BATCH]
    with torch.no_grad():
        return float(F.cross_entropy(model.net(x), y))


def _values(message: str) -> tuple[float, float]:
    """(the schedule's loss, the loss training_step returned) named in a refusal."""
    found = re.search(r", ([-\d.e+]+) on this batch, but training_step returned ([-\d.e+]+)",
                      message)  # fmt: skip
    assert found, message
    return float(found.group(1)), float(found.group(2))


def _refused_everywhere(ranks: list[dict], cell: str, who: str, schedule: str) -> list[str]:
    messages = [rank[cell] for rank in ranks]
    for message in messages:
        assert isinstance(message, str), f"{cell} was not refused"
        assert f"{who}(schedule={schedule!r}) back-propagates the loss" in message
        assert FIX in message and "or use schedule='gpipe'" in message
    return messages


def test_an_l2_term_is_refused_at_the_first_step_on_every_rank(ranks):
    ce = _first_loss()
    everything = Classifier()
    l2 = 0.01 * sum(float(p.detach().pow(2).sum()) for p in everything.parameters())
    for cell, who in [("l2-1f1b", "gpipe"), ("l2-hybrid-1f1b", "hybrid")]:
        for message in _refused_everywhere(ranks, cell, who, "1f1b"):
            computed, returned = _values(message)
            assert "loss_fn=CrossEntropyLoss()" in message
            assert computed == pytest.approx(ce, rel=1e-5)  # the first batch: first step
            assert ce < returned <= ce + l2 + 1e-5  # a stage's own parameters' L2 term


def test_an_l2_term_reaches_the_users_script_as_a_value_error():
    fit = _trainer(GPipeStrategy(chunks=2, schedule="1f1b", loss_fn=nn.CrossEntropyLoss()), 2)
    with pytest.raises(ValueError) as refused:
        fit.fit(Classifier("l2"))
    message = str(refused.value)
    assert "gpipe(schedule='1f1b') back-propagates the loss" in message and FIX in message
    computed, returned = _values(message)
    assert computed == pytest.approx(_first_loss(), rel=1e-5) and returned > computed


def _assert_like_one_process(ranks: list[dict], cell: str, tol: float) -> None:
    variant, _, options = CELLS[cell]
    expected = _one_process(variant, **options).state_dict()
    for rank in ranks:
        assert not isinstance(rank[cell], str), rank[cell]
        assert rank[cell][1] == STEPS
    state = ranks[0][cell][0]  # the full model, gathered on rank 0
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=tol, atol=tol, msg=f"{cell}: {key}")


@pytest.mark.parametrize(
    "cell, schedule", [("smoothing-zero_bubble", "zero_bubble"),
                       ("weighted-interleaved", "interleaved")],
)  # fmt: skip
def test_label_smoothing_or_a_weight_is_refused(ranks, cell, schedule):
    for message in _refused_everywhere(ranks, cell, "gpipe", schedule):
        computed, returned = _values(message)
        assert computed == pytest.approx(_first_loss(), rel=1e-5)
        if cell.startswith("weighted"):
            assert returned == pytest.approx(2 * computed, rel=1e-5)
        else:
            assert returned == pytest.approx(_first_loss(), rel=0.2)
            assert returned != pytest.approx(computed, rel=1e-4)
    if cell.startswith("smoothing"):  # the fix: the smoothing inside loss_fn
        _assert_like_one_process(ranks, "smoothing-fixed", 1e-5)


def test_under_accumulation_the_same_loss_trains_and_another_is_refused(ranks):
    # Lightning divides the returned loss by accumulate_grad_batches before backward: the
    # message names the loss training_step returned (twice the cross entropy), not half of it
    for message in _refused_everywhere(ranks, "weighted-accumulate", "gpipe", "1f1b"):
        computed, returned = _values(message)
        assert returned == pytest.approx(2 * computed, rel=1e-5)
        assert computed == pytest.approx(_first_loss(), rel=1e-5)
    _assert_like_one_process(ranks, "same-accumulate", 1e-5)


def test_under_bf16_mixed_float32_losses_keep_the_tight_tolerance(ranks):
    # autocast computes the cross entropy in float32: label smoothing (0.2% here) is caught
    for message in _refused_everywhere(ranks, "smoothing-bf16", "gpipe", "interleaved"):
        computed, returned = _values(message)
        assert "relative 0.0001 for float32 losses" in message
        assert abs(returned - computed) < 1e-2 * computed  # below the 16-bit tolerance
    _assert_like_one_process(ranks, "same-bf16", 1e-2)


def test_a_loss_in_16_bits_gets_the_loose_tolerance(ranks):
    for message in _refused_everywhere(ranks, "weighted-half", "gpipe", "interleaved"):
        computed, returned = _values(message)
        assert "relative 0.01 for 16-bit losses" in message
        assert returned == pytest.approx(2 * computed, rel=1e-2)
    _assert_like_one_process(ranks, "half-bf16", 1e-2)  # not refused: within 1e-2


def test_under_manual_optimisation_the_loss_given_to_manual_backward_is_compared(ranks):
    for message in _refused_everywhere(ranks, "weighted-manual", "gpipe", "1f1b"):
        computed, returned = _values(message)
        assert returned == pytest.approx(2 * computed, rel=1e-5)
    _assert_like_one_process(ranks, "same-manual", 1e-5)
