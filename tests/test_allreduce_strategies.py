"""Allreduce strategies train exactly like one process on the concatenated batch (how the
gradients are averaged, bucket by bucket, with accumulation, clipping, manual optimisation,
mixed precision and unused parameters: ``test_allreduce_gradients.py``, which takes its
helpers from here, as other strategies' tests do).

Most tests run Lightning inside ranks started by ``run_on_ranks`` (the torchrun path: the
processes exist, the strategy launches nothing), several fits per launch to keep the
suite fast; one test uses the registered name with Lightning's own fork launcher.
"""

from __future__ import annotations

import copy
import time
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par.comm import default_timeout, run_on_ranks
from lightning_par.models import CifarCNN, CifarRNN
from lightning_par.strategies.allreduce import AllReduceStrategy

STRATEGIES = (
    "ring_allreduce",
    "tree_allreduce",
    "butterfly_allreduce",
    "all_to_all_allreduce",
    "master_worker_allreduce",
)
STEPS, PER_RANK = 5, 4
ATOL = 1e-5  # float32 rounding of a different summation order, after 5 SGD steps


def make_model(kind: str) -> pl.LightningModule:
    torch.manual_seed(0)
    if kind == "cnn":
        return CifarCNN(width=8, num_blocks=2, scheduler=None, lr=0.05)
    return CifarRNN(hidden_size=16, num_layers=2, optimizer="sgd", scheduler=None, lr=0.1)


def expected_launch() -> str:
    """How a Lightning launch in this process starts its ranks: fork, or a forkserver where
    fork is unsafe (a GPU machine after a backward pass here)."""
    from lightning_par.launch.policy import process_state

    return "forkserver" if process_state().fork_hazards else "fork"


def global_batches(world_size: int, steps: int = STEPS, per_rank: int = PER_RANK):
    g = torch.Generator().manual_seed(123)
    n = steps * world_size * per_rank
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def shard(x, y, rank: int, world_size: int, per_rank: int = PER_RANK) -> DataLoader:
    """Rank ``rank``'s slice of every global batch (so the union is the single-process batch)."""
    batch = world_size * per_rank
    rows = [
        torch.arange(i * batch + rank * per_rank, i * batch + (rank + 1) * per_rank)
        for i in range(len(x) // batch)
    ]
    index = torch.cat(rows)
    return DataLoader(TensorDataset(x[index], y[index]), batch_size=per_rank)


def trainer(strategy, world_size: int, **kw) -> pl.Trainer:
    kw.setdefault("max_steps", STEPS)
    kw.setdefault("use_distributed_sampler", False)  # tests shard explicitly
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world_size,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def flat_weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def portable(t: torch.Tensor | None):
    """A tensor as a numpy array: results leave the rank through a pipe, and torch would
    send a tensor as a shared-memory handle that dies with the rank."""
    return None if t is None else t.detach().numpy().copy()


def single_process(model, init, x, y, batch: int, steps: int, clip: float | None = None):
    """The reference: one process, whole global batches, plain PyTorch loop."""
    model.load_state_dict(init)
    opt = model.configure_optimizers()
    for i in range(steps):
        opt.zero_grad()
        model.criterion(
            model(x[i * batch : (i + 1) * batch]), y[i * batch : (i + 1) * batch]
        ).backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return flat_weights(model)


def _equivalence(rank: int, world_size: int, combos) -> dict:
    x, y = global_batches(world_size)
    out = {}
    for strategy, kind in combos:
        model = make_model(kind)
        if rank != 0:  # different starts: the strategy must broadcast rank 0's weights
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.1)
        init = copy.deepcopy(model.state_dict())
        trainer(strategy, world_size).fit(model, shard(x, y, rank, world_size))
        trained = flat_weights(model)
        reference_init = make_model(kind).state_dict()
        ref = single_process(make_model(kind), reference_init, x, y, world_size * PER_RANK, STEPS)
        out[(strategy, kind)] = (portable(trained), (trained - ref).abs().max().item())
        del init
    return out


def _check(results, world_size):
    for key in results[0]:
        weights0, diff = results[0][key]
        assert diff < ATOL, f"{key} on {world_size} ranks: max |w - w_single| = {diff:.2e}"
        for rank in range(1, world_size):
            assert (results[rank][key][0] == weights0).all(), f"{key}: rank {rank} drifted"


def test_every_strategy_matches_one_process_on_two_ranks():
    combos = [(s, kind) for s in STRATEGIES for kind in ("cnn", "rnn")]
    _check(run_on_ranks(_equivalence, 2, combos, timeout=120), 2)


@pytest.mark.parametrize("world_size", [3, 4])
def test_every_strategy_matches_one_process_on_three_and_four_ranks(world_size):
    # CNN for every strategy, RNN for the three real algorithms (the baselines' RNN runs at 2).
    combos = [(s, "cnn") for s in STRATEGIES] + [(s, "rnn") for s in STRATEGIES[:3]]
    _check(run_on_ranks(_equivalence, world_size, combos, timeout=120), world_size)


def _reference_on_one_rank(rank, world_size, kind, ranks):
    x, y = global_batches(ranks)
    model = make_model(kind)
    return portable(single_process(model, model.state_dict(), x, y, ranks * PER_RANK, STEPS))


class RankShard(torch.utils.data.Dataset):
    """Rank r's slice of every global batch, chosen in the rank (after Lightning forked it)."""

    def __init__(self, x, y, world_size: int):
        self.x, self.y, self.world_size = x, y, world_size

    def __len__(self):
        return len(self.x) // self.world_size

    def __getitem__(self, i):
        step, j = divmod(i, PER_RANK)
        row = step * self.world_size * PER_RANK + dist.get_rank() * PER_RANK + j
        return self.x[row], self.y[row]


def test_registered_name_with_default_arguments_and_fork_launch():
    # What `python -m lightning_par.check` and notebooks do: Lightning forks the ranks;
    # rank 0's weights come back to this process.
    x, y = global_batches(2)
    model = make_model("cnn")
    run = trainer("ring_allreduce", 2)
    assert isinstance(run.strategy, AllReduceStrategy) and run.strategy.algorithm_name == "ring"
    run.fit(model, DataLoader(RankShard(x, y, 2), batch_size=PER_RANK))
    # (a forkserver where fork is unsafe here: a GPU machine after a backward pass)
    assert run.strategy.launch_plan.method == expected_launch()
    # The reference runs in a forked child: this process stays free of autograd state.
    (reference,) = run_on_ranks(_reference_on_one_rank, 1, "cnn", 2)
    assert abs(flat_weights(model).numpy() - reference).max() < ATOL


def test_bad_options_fail_before_training():
    with pytest.raises(ValueError, match="bucket_cap_mb must be > 0"):
        AllReduceStrategy("ring", bucket_cap_mb=0)
    with pytest.raises(ValueError, match="bucket_cap_mb must be > 0"):
        AllReduceStrategy("ring", bucket_cap_mb=-1)
    with pytest.raises(TypeError, match="bucket_cap_mb must be a number"):
        AllReduceStrategy("ring", bucket_cap_mb="big")
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'rnig'.*ring"):
        AllReduceStrategy(algorithm="rnig")
    with pytest.raises(ValueError, match="needs an algorithm"):
        AllReduceStrategy()
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['bucket_size'\]"):
        AllReduceStrategy("ring", bucket_size=4)
    with pytest.raises(TypeError, match="no DistributedDataParallel wrapper"):
        AllReduceStrategy("ring", find_unused_parameters=True)
    with pytest.raises(ValueError, match="start_method='thread'"):
        AllReduceStrategy("ring", start_method="thread")


class HangsOnRankOne(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def training_step(self, batch, i):
        if self.global_rank == 1 and i == 1:
            time.sleep(600)  # a rank that never reaches the allreduce
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_hung_rank_fails_the_fork_launched_run_fast_naming_it():
    # The default timeout is ours (LIGHTNING_PAR_TIMEOUT, 60 s), not Lightning's 30 min.
    assert AllReduceStrategy("ring")._timeout == default_timeout()
    strategy = AllReduceStrategy("ring", timeout=timedelta(seconds=4))
    data = TensorDataset(torch.randn(32, 4), torch.zeros(32))
    start = time.monotonic()
    with pytest.raises(
        Exception, match=r"(?s)rank 0: (send to|recv from) rank 1 failed.*look at its own"
    ):
        trainer(strategy, 2, max_steps=4).fit(HangsOnRankOne(), DataLoader(data, batch_size=4))
    assert time.monotonic() - start < 40
