"""Ranks started by a forkserver own their weights (torch pickles tensors into shared memory,
so without a copy every rank's optimiser stepped the same pages: each update applied
world-size times, found by ``python -m lightning_par.compare``)."""

import time

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_par.launch.run import run_on_ranks
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


def _add_rank(rank: int, world_size: int, tensor: torch.Tensor, module: torch.nn.Module):
    time.sleep(0.3 * rank)  # rank 1 reads after rank 0 wrote: shared pages would show it
    tensor.add_(rank + 1)
    with torch.no_grad():
        module.weight.add_(rank + 1)
    time.sleep(0.3)
    return tensor.clone(), module.weight.detach().clone()


def test_run_on_ranks_under_a_forkserver_gives_each_rank_its_own_arguments(monkeypatch):
    monkeypatch.setenv("LIGHTNING_PAR_START_METHOD", "forkserver")
    linear = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(linear.weight)
    results = run_on_ranks(_add_rank, 2, torch.zeros(3), linear, timeout=60)
    for rank, (tensor, weight) in enumerate(results):
        assert torch.equal(tensor, torch.full((3,), rank + 1.0))
        assert torch.equal(weight, torch.full((1, 2), rank + 1.0))


def test_own_copies_reaches_into_containers_and_frozen_dataclasses():
    import dataclasses

    from lightning_par.launch.run import own_copies

    @dataclasses.dataclass(frozen=True)
    class Frozen:
        weight: torch.Tensor
        value: float = 1.0

    shared = torch.ones(3).share_memory_()
    data = ([shared], {"a": shared}, Frozen(shared), 7)
    owned = own_copies(data)
    tensors = [owned[0][0], owned[1]["a"], owned[2].weight]
    assert all(not t.is_shared() and torch.equal(t, shared) for t in tensors)
    assert owned[2].value == 1.0 and owned[3] == 7 and isinstance(owned[2], Frozen)
    tensors[0].add_(1)
    assert float(shared.sum()) == 3.0  # the caller's shared tensor is untouched
