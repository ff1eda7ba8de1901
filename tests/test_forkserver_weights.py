"""Ranks started by a forkserver own their weights (torch pickles tensors into shared memory,
so without a copy every rank's optimiser stepped the same pages: each update applied
world-size times, found by ``python -m lightning_par.compare``)."""

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_par.models import CifarCNN
from lightning_par.strategies.allreduce import AllReduceStrategy
from lightning_par.strategies.reference import LightningDDPStrategy

STEPS, BATCH = 2, 4  # per rank


def _model() -> CifarCNN:
    torch.manual_seed(0)
    return CifarCNN(width=4, num_blocks=1, scheduler=None, momentum=0.0, weight_decay=0.0)


def _data() -> TensorDataset:
    # Every sample the same: each rank's shard has the global batch's gradient, whatever
    # the sampler gives it, so one process on one batch is the exact reference.
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    return TensorDataset(x.repeat(64, 1, 1, 1), torch.full((64,), 3))


def _one_process() -> list[torch.Tensor]:
    model = _model()
    opt = model.configure_optimizers()
    x, y = _data()[: 2 * BATCH]
    for _ in range(STEPS):
        opt.zero_grad()
        model.criterion(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("make", [lambda: AllReduceStrategy("ring", start_method="forkserver"),
                                  lambda: LightningDDPStrategy(start_method="forkserver")],
                         ids=["ring_allreduce", "lightning_ddp"])  # fmt: skip
def test_forkserver_ranks_step_their_own_weights_like_one_process(make):
    model = _model()
    trainer = pl.Trainer(
        strategy=make(), accelerator="cpu", devices=2, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, DataLoader(_data(), batch_size=BATCH))
    assert trainer.strategy.launch_plan.method == "forkserver"
    for got, want in zip(model.parameters(), _one_process()):
        torch.testing.assert_close(got.detach(), want, rtol=1e-4, atol=1e-5)
