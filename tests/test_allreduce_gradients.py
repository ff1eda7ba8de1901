"""How the allreduce strategies average gradients: buckets that start during backward,
gradient accumulation and clipping, manual optimisation and mixed precision, unused
parameters, and averages scaled once and accumulated in place, each against one process
(helpers from ``test_allreduce_strategies.py``)."""

from __future__ import annotations

import lightning.pytorch as pl
import numpy as np
import torch
from test_allreduce_strategies import (
    ATOL,
    PER_RANK,
    STEPS,
    flat_weights,
    global_batches,
    make_model,
    portable,
    shard,
    single_process,
    trainer,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par.collectives import ring_allreduce
from lightning_par.comm import Communicator, run_on_ranks
from lightning_par.comm.buckets import allreduce_buckets
from lightning_par.models import CifarCNN
from lightning_par.strategies.allreduce import AllReduceStrategy


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
