"""Allreduce strategies train exactly like one process on the concatenated batch.

Most tests run Lightning inside ranks started by ``run_on_ranks`` (the torchrun path: the
processes exist, the strategy launches nothing), several fits per launch to keep the
suite fast; one test uses the registered name with Lightning's own fork launcher.
"""

from __future__ import annotations

import copy
import time
from datetime import timedelta

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par.collectives import ring_allreduce
from lightning_par.comm import Communicator, default_timeout, run_on_ranks
from lightning_par.comm.buckets import allreduce_buckets
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


def _overlap(rank: int, world_size: int) -> dict:
    class Deep(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            # The first layers' gradients come last; their backward takes a while.
            self.net = nn.Sequential(
                *[nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(6)],
                nn.Linear(512, 10),
            )

        def training_step(self, batch, i):
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = TensorDataset(torch.randn(3 * 256, 512), torch.randint(0, 10, (3 * 256,)))
    strategy = AllReduceStrategy("ring", bucket_cap_mb=1.0, trace=True)
    trainer(strategy, world_size, max_steps=3).fit(Deep(), DataLoader(data, batch_size=256))
    trace = strategy.trace
    backward = [e for e in trace.events if e.name == "backward"]
    buckets = [e for e in trace.events if e.name.startswith("bucket")]
    # Buckets started during a backward: their first message precedes the backward's end.
    started_early = sum(
        any(m.start < b.end and m.start > b.start for m in trace.messages) for b in backward
    )
    return {
        "backward_steps": len(backward),
        "buckets": len(buckets),
        "started_early": started_early,
        "first_bucket_before_backward_end": sum(
            bk.start < bw.end for bk in buckets for bw in backward if bw.start <= bk.start
        ),
    }


def test_bucket_communication_starts_before_backward_ends():
    for rank_result in run_on_ranks(_overlap, 2, timeout=120):
        assert rank_result["backward_steps"] == 3
        assert rank_result["buckets"] >= 3 * 4  # 7 x 1 MiB of weights -> several buckets/step
        assert rank_result["started_early"] == 3, rank_result
        assert rank_result["first_bucket_before_backward_end"] >= 3, rank_result


def _accumulate_and_clip(rank: int, world_size: int) -> dict:
    out = {}
    x, y = global_batches(world_size, steps=4)
    batch = world_size * PER_RANK
    # Accumulation: 2 micro-batches per step -> the reference steps on 2 global batches.
    model = make_model("cnn")
    strategy = AllReduceStrategy("ring", trace=True)
    trainer(strategy, world_size, max_steps=2, accumulate_grad_batches=2).fit(
        model, shard(x, y, rank, world_size)
    )
    ref = make_model("cnn")
    opt = ref.configure_optimizers()
    for step in range(2):
        opt.zero_grad()
        for micro in (2 * step, 2 * step + 1):
            chunk = slice(micro * batch, (micro + 1) * batch)
            (ref.criterion(ref(x[chunk]), y[chunk]) / 2).backward()
        opt.step()
    out["accumulate_diff"] = (flat_weights(model) - flat_weights(ref)).abs().max().item()
    out["synced_backwards"] = sum(e.name == "backward" for e in strategy.trace.events)
    n_params = sum(p.numel() for p in model.parameters())
    out["bytes_per_sync"] = strategy.trace.bytes_sent / 2
    out["n_params"] = n_params
    # Clipping must see the averaged gradients (clipping local ones gives other weights).
    model = make_model("cnn")
    trainer("butterfly_allreduce", world_size, max_steps=4, gradient_clip_val=0.05).fit(
        model, shard(x, y, rank, world_size)
    )
    ref = single_process(
        make_model("cnn"), make_model("cnn").state_dict(), x, y, batch, STEPS - 1, 0.05
    )
    out["clip_diff"] = (flat_weights(model) - ref).abs().max().item()
    return out


def test_gradient_accumulation_and_clipping():
    for out in run_on_ranks(_accumulate_and_clip, 2, timeout=120):
        assert out["accumulate_diff"] < ATOL, out
        assert out["synced_backwards"] == 2, "accumulating micro-steps must not communicate"
        # One ring per step over all gradients (+ one flag per parameter): ~n elements on 2 ranks.
        assert out["n_params"] * 4 <= out["bytes_per_sync"] < out["n_params"] * 4 * 1.01, out
        assert out["clip_diff"] < ATOL, out


class ManualModel(CifarCNN):
    def __init__(self):
        super().__init__(width=8, num_blocks=2, scheduler=None, lr=0.05)
        self.automatic_optimization = False

    def training_step(self, batch, i):
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        loss = self.criterion(self(x), y)
        self.manual_backward(loss)
        opt.step()
        return loss


def _manual_and_mixed(rank: int, world_size: int) -> dict:
    x, y = global_batches(world_size)
    torch.manual_seed(0)
    model = ManualModel()
    trainer("tree_allreduce", world_size).fit(model, shard(x, y, rank, world_size))
    torch.manual_seed(0)
    reference = ManualModel()
    ref = single_process(reference, reference.state_dict(), x, y, world_size * PER_RANK, STEPS)
    manual_diff = (flat_weights(model) - ref).abs().max().item()
    mixed = make_model("cnn")
    trainer("ring_allreduce", world_size, precision="bf16-mixed").fit(
        mixed, shard(x, y, rank, world_size)
    )
    return {"manual_diff": manual_diff, "mixed": portable(flat_weights(mixed))}


def test_manual_optimization_and_mixed_precision():
    results = run_on_ranks(_manual_and_mixed, 2, timeout=120)
    for out in results:
        assert out["manual_diff"] < ATOL, out["manual_diff"]
    assert np.isfinite(results[0]["mixed"]).all()
    assert (results[0]["mixed"] == results[1]["mixed"]).all(), "bf16-mixed replicas drifted"


def _unused(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    used, sometimes, never = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    module = nn.ModuleList([used, sometimes, never])
    buckets = allreduce_buckets(module, ring_allreduce, Communicator(), bucket_cap_mb=1e-4)
    x = torch.full((2, 4), float(rank + 1))
    out = used(x)
    if rank == 0:
        out = sometimes(out)  # only rank 0 uses this layer
    out.sum().backward()
    local_sometimes = sometimes.weight.grad.clone() if rank == 0 else None
    buckets.synchronize()
    buckets.close()
    return {
        "used": portable(used.weight.grad),
        "sometimes": portable(sometimes.weight.grad),
        "local_sometimes": portable(local_sometimes),
        "never": portable(never.weight.grad),
        "n_buckets": len(buckets.buckets),
    }


def test_unused_parameters_count_as_zero_and_stay_none_if_unused_everywhere():
    results = run_on_ranks(_unused, 2)
    r0, r1 = results
    assert r0["n_buckets"] > 1
    assert (r0["used"] == r1["used"]).all()
    assert np.allclose(r0["sometimes"], r0["local_sometimes"] / 2)
    assert (r1["sometimes"] == r0["sometimes"]).all()
    assert r0["never"] is None and r1["never"] is None


def _steps_in_place(rank: int, world_size: int) -> dict:
    """Three synchronised backwards of one layer: zeroed in place, then not zeroed at all."""
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    buckets = allreduce_buckets(layer, ring_allreduce, Communicator(), bucket_cap_mb=1.0)
    seen = []
    for step in range(3):
        if step == 1:
            layer.zero_grad(set_to_none=False)  # zeroed in place: the same gradient tensors
        x = torch.full((2, 3), float(rank + 1 + 10 * step))
        layer(x).pow(2).sum().backward()
        buckets.synchronize()
        seen.append(portable(layer.weight.grad))
    own = layer.weight.grad.data_ptr() != buckets.buckets[0].views[1].data_ptr()
    buckets.close()
    return {"grads": seen, "own": own}


def test_averaged_gradients_are_scaled_once_and_accumulate_in_place():
    results = run_on_ranks(_steps_in_place, 2)

    def local(rank, step, layer):  # one rank's own gradient of that step
        layer.zero_grad()
        layer(torch.full((2, 3), float(rank + 1 + 10 * step))).pow(2).sum().backward()
        return layer.weight.grad.clone()

    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    mean = [(local(0, s, layer) + local(1, s, layer)) / 2 for s in range(3)]
    # step 0: the average; step 1: zeroed in place first; step 2: not zeroed, so the
    # average accumulates onto step 1's, as in one process
    expected = [mean[0], mean[1], mean[1] + mean[2]]
    for out in results:
        assert out["own"], "a gradient must stay its own tensor, not a view of the bucket"
        for got, want in zip(out["grads"], expected):
            assert np.allclose(got, want.numpy(), rtol=1e-6), (got, want)


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
