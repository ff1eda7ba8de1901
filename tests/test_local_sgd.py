"""Local SGD: independent steps, parameters averaged every H steps or once per epoch.

Ranks run Lightning inside ``run_on_ranks`` (the torchrun path), several fits per launch;
one test uses the registered name with the fork launcher.
"""

from __future__ import annotations

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from test_allreduce_strategies import (
    ATOL,
    PER_RANK,
    RankShard,
    expected_launch,
    flat_weights,
    global_batches,
    portable,
    shard,
    trainer,
)
from torch import nn
from torch.utils.data import DataLoader

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par.collectives import average_parameters, tree_allreduce
from lightning_par.collectives.averaging import replicas_equal
from lightning_par.comm import Communicator, run_on_ranks
from lightning_par.models import CifarCNN
from lightning_par.strategies.local_sgd import LocalSGDStrategy


def make_cnn(momentum: float = 0.0, norm: str = "group") -> CifarCNN:
    torch.manual_seed(0)
    return CifarCNN(width=8, num_blocks=2, norm=norm, scheduler=None, lr=0.05, momentum=momentum)


class ReplicaWatch(pl.Callback):
    """After every training batch (optimiser step and any averaging done), whether all
    ranks hold identical weights and buffers (a collective: every rank calls it)."""

    def __init__(self) -> None:
        self.equal: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.equal.append(replicas_equal(pl_module))


def _average_function(rank: int, world_size: int) -> dict:
    torch.manual_seed(rank)
    net = nn.Sequential(nn.Linear(5, 3), nn.BatchNorm1d(3))
    net[1].running_mean.fill_(float(rank))
    net[1].num_batches_tracked.fill_(rank + 7)
    expected = [t.detach().clone() for t in [*net.parameters(), net[1].running_mean]]
    for t in expected:
        torch.distributed.all_reduce(t)
        t /= world_size
    n = average_parameters(net, tree_allreduce, Communicator())
    got = [*net.parameters(), net[1].running_mean]
    return {
        "diff": max((a - b).abs().max().item() for a, b in zip(got, expected)),
        "n": n,
        "counter": int(net[1].num_batches_tracked),
        "equal": replicas_equal(net),
    }


def test_average_parameters_is_the_mean_of_floating_tensors():
    for rank, out in enumerate(run_on_ranks(_average_function, 3, timeout=60)):
        assert out["diff"] < 1e-6, out
        assert out["n"] == 5 * 3 + 5 * 3  # weight; bias, gamma, beta, running mean and var
        assert out["counter"] == rank + 7, "integer buffers are counters, not averaged"
        assert out["equal"]


def _period_one(rank: int, world_size: int) -> dict:
    x, y = global_batches(world_size)
    local = make_cnn()
    trainer(LocalSGDStrategy(period=1), world_size).fit(local, shard(x, y, rank, world_size))
    ring = make_cnn()
    trainer("ring_allreduce", world_size).fit(ring, shard(x, y, rank, world_size))
    return {"local": portable(flat_weights(local)), "ring": portable(flat_weights(ring))}


def test_period_one_with_plain_sgd_equals_ring_allreduce():
    results = run_on_ranks(_period_one, 2, timeout=120)
    for out in results:
        assert abs(out["local"] - out["ring"]).max() < ATOL
        assert abs(out["local"] - results[0]["ring"]).max() < ATOL
    # The check has teeth: the runs trained (weights moved from the start).
    assert abs(results[0]["ring"] - flat_weights(make_cnn()).numpy()).max() > 1e-3


def _watch(rank: int, world_size: int) -> dict:
    out = {}
    x, y = global_batches(world_size, steps=8)
    # H = 4, BatchNorm (running statistics are averaged too), local momentum.
    watch, strategy = ReplicaWatch(), LocalSGDStrategy(period=4, trace=True)
    trainer(strategy, world_size, max_steps=8, callbacks=[watch]).fit(
        make_cnn(momentum=0.9, norm="batch"), shard(x, y, rank, world_size)
    )
    spans = sum(e.name == "average" for e in strategy.trace.events)
    out["h4"] = (watch.equal, strategy.averagings, spans)
    # period=None: 2 epochs of 3 batches -> averaged after batches 3 and 6.
    x, y = global_batches(world_size, steps=3)
    watch, strategy = ReplicaWatch(), LocalSGDStrategy(period=None)
    trainer(strategy, world_size, max_steps=-1, max_epochs=2, callbacks=[watch]).fit(
        make_cnn(), shard(x, y, rank, world_size)
    )
    out["epoch"] = (watch.equal, strategy.averagings)
    # A run that stops mid-epoch (max_steps) still ends with one model on every rank.
    model, strategy = make_cnn(), LocalSGDStrategy(period=None)
    trainer(strategy, world_size, max_steps=2).fit(model, shard(x, y, rank, world_size))
    out["stopped"] = (replicas_equal(model), strategy.averagings)
    return out


def test_replicas_differ_between_averagings_and_agree_right_after():
    for out in run_on_ranks(_watch, 2, timeout=180):
        equal, averagings, spans = out["h4"]
        assert equal == [False, False, False, True] * 2, equal
        assert averagings == spans == 2
        equal, averagings = out["epoch"]
        assert equal == [False, False, True] * 2, equal
        assert averagings == 2  # nothing left to average at the end of fit
        assert out["stopped"] == (True, 1)


def test_bad_options_fail_before_launch():
    for bad in (0, -3):
        with pytest.raises(ValueError, match="period must be >= 1 optimiser step"):
            LocalSGDStrategy(period=bad)
    for bad in (2.5, "4", True):
        with pytest.raises(TypeError, match="period must be a whole number"):
            LocalSGDStrategy(period=bad)
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'rnig'"):
        LocalSGDStrategy(algorithm="rnig")
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['bucket_cap_mb'\]"):
        LocalSGDStrategy(bucket_cap_mb=4)
    with pytest.raises(ValueError, match="period must be >= 1"):
        pl.Trainer(strategy=LocalSGDStrategy(period=0), accelerator="cpu", devices=2)


def _simulated_local_sgd(rank, world_size, ranks: int, steps: int, period: int):
    """The reference in one process: ``ranks`` replicas with their own momentum SGD, each on
    its own shard, parameters averaged after every ``period`` steps and at the end."""
    x, y = global_batches(ranks, steps=steps)
    replicas = [make_cnn(momentum=0.9) for _ in range(ranks)]
    optimizers = [m.configure_optimizers() for m in replicas]
    loaders = [iter(shard(x, y, r, ranks)) for r in range(ranks)]
    for step in range(1, steps + 1):
        for model, opt, loader in zip(replicas, optimizers, loaders):
            xb, yb = next(loader)
            opt.zero_grad()
            model.criterion(model(xb), yb).backward()
            opt.step()
        if step % period == 0 or step == steps:
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in replicas)):
                    mean = sum(p.detach() for p in ps) / ranks
                    for p in ps:
                        p.copy_(mean)
    return portable(flat_weights(replicas[0]))


def test_fork_launched_fit_returns_the_averaged_weights():
    x, y = global_batches(2, steps=6)
    model = make_cnn(momentum=0.9)
    run = trainer("local_sgd", 2, max_steps=6)  # registered default: period 4, ring
    assert isinstance(run.strategy, LocalSGDStrategy) and run.strategy.period == 4
    run.fit(model, DataLoader(RankShard(x, y, 2), batch_size=PER_RANK))
    # (a forkserver where fork is unsafe here: a GPU machine after a backward pass)
    assert run.strategy.launch_plan.method == expected_launch()
    # Averaged after step 4 and at the end (step 6), each replica with its own momentum.
    (reference,) = run_on_ranks(_simulated_local_sgd, 1, 2, 6, 4)
    got = flat_weights(model).numpy()
    assert np.abs(got - reference).max() < ATOL
    assert np.abs(got - flat_weights(make_cnn()).numpy()).max() > 1e-3
