"""``zero`` (ZeRO stages 1, 2, 3) trains exactly like one process on the whole batch.

Each check runs Lightning inside ranks started by ``run_on_ranks`` (the torchrun path),
several fits per launch; the reference is Lightning on one device with the same Trainer
options reading the concatenated batches. Where the sums run in the same order as
``ring_allreduce``'s the weights are the same bits: stage 1 always (it sums with the ring
allreduce itself), stages 2-3 on two ranks (a sum of two numbers does not depend on which
rank starts it; with three or more the reduce-scatter starts each chunk's sum one rank
later than the fused ring does, so only float tolerance holds).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par.comm import run_on_ranks
from lightning_par.models import CifarCNN, CifarRNN
from lightning_par.strategies.zero import ZeroStrategy
from tests.test_allreduce_strategies import PER_RANK, global_batches, shard, trainer

ATOL = 2e-5


def make(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "cnn":
        return CifarCNN(width=8, num_blocks=2, scheduler=None, lr=0.05)
    if kind == "cnn-adam":
        return CifarCNN(width=8, num_blocks=2, scheduler=None, lr=0.01, optimizer="adam")
    return CifarRNN(hidden_size=16, num_layers=2, optimizer="adam", scheduler=None, lr=0.01)


def weights(model: nn.Module) -> list:
    return [p.detach().numpy().copy() for p in model.state_dict().values()]


def one_process(kind: str, world_size: int, **options) -> list:
    x, y = global_batches(world_size)
    model = make(kind)
    loader = DataLoader(TensorDataset(x, y), batch_size=world_size * PER_RANK)
    trainer("auto", 1, **options).fit(model, loader)
    return weights(model)


def _fit(rank: int, world_size: int, runs) -> dict:
    x, y = global_batches(world_size)
    out = {}
    for key, strategy, kind, options in runs:
        model = make(kind)
        if rank:  # every rank must start from rank 0's weights
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.1)
        trainer(strategy, world_size, **options).fit(model, shard(x, y, rank, world_size))
        out[key] = weights(model)
    return out


def fit_on_ranks(world_size: int, runs) -> list[dict]:
    return run_on_ranks(_fit, world_size, runs, timeout=300)


def assert_same(got: list, want: list, exact: bool, what: str, **tolerance: float) -> None:
    """Equal bits (``exact``), or equal within float tolerance (default :data:`ATOL`)."""
    tolerance = tolerance or {"atol": ATOL, "rtol": 1e-4}
    for n, (a, b) in enumerate(zip(got, want)):
        if exact:
            assert (a == b).all(), f"{what}: tensor {n} differs from the reference's bits"
        else:
            diff = torch.from_numpy(a).double() - torch.from_numpy(b).double()
            bound = tolerance["atol"] + tolerance["rtol"] * torch.from_numpy(b).double().abs()
            assert (diff.abs() <= bound).all(), (
                f"{what}: tensor {n}: max |diff| {diff.abs().max():.2e}"
            )


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_stage_trains_the_cnn_and_the_rnn_like_one_process(world_size):
    kinds = ("cnn", "cnn-adam", "rnn")
    runs = [((s, k), ZeroStrategy(stage=s), k, {}) for s in (1, 2, 3) for k in kinds]
    runs += [(("ring", k), "ring_allreduce", k, {}) for k in kinds]
    results = fit_on_ranks(world_size, runs)
    for kind in kinds:
        want = one_process(kind, world_size)
        ring = results[0][("ring", kind)]
        for stage in (1, 2, 3):
            got = results[0][(stage, kind)]
            for rank in range(1, world_size):
                assert_same(results[rank][(stage, kind)], got, True, f"rank {rank} drifted")
            assert_same(got, want, False, f"stage {stage} {kind} vs one process")
            bitwise = stage == 1 or world_size == 2
            assert_same(got, ring, bitwise, f"stage {stage} {kind} vs ring_allreduce")


FEATURES = {
    "clip": {"gradient_clip_val": 0.05},
    "accumulate": {"accumulate_grad_batches": 2, "max_steps": 2},
    "bf16": {"precision": "bf16-mixed"},
}


def test_clipping_accumulation_and_bf16_like_one_process():
    """Clipping by the norm of every rank's shards together, accumulation over micro-steps
    (no communication until the last), bf16-mixed, at every stage: the same bits as
    ``ring_allreduce`` on two ranks (clipping to float tolerance: its norm adds the shards'
    squares), and one process's weights (bf16's own rounding depends on the batch each
    matmul sees, so there only to bf16's tolerance)."""
    runs = [((name, stage), ZeroStrategy(stage=stage), "cnn-adam", opts)
            for name, opts in FEATURES.items() for stage in (1, 2, 3)]  # fmt: skip
    runs += [
        ((name, "ring"), "ring_allreduce", "cnn-adam", opts) for name, opts in FEATURES.items()
    ]
    results = fit_on_ranks(2, runs)
    for name, opts in FEATURES.items():
        want = one_process("cnn-adam", 2, **opts)
        tolerance = {"atol": 5e-2, "rtol": 5e-2} if name == "bf16" else {}
        for stage in (1, 2, 3):
            got = results[0][(name, stage)]
            bitwise = name != "clip"  # the clipping norm sums the shards' squares: another order
            assert_same(got, results[0][(name, "ring")], bitwise, f"{name}, stage {stage} vs ring")
            assert_same(got, want, False, f"{name}, stage {stage} vs one process", **tolerance)


def _checkpointed(rank: int, world_size: int, folder: str, stage) -> dict:
    """Fit 4 steps saving a checkpoint every 2 (mid-fit: stage 3's units are sharded then),
    then resume a new fit from the step-2 checkpoint; both under ``stage`` ("one": one
    process reading the whole batches)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    x, y = global_batches(world_size, steps=4)
    if stage == "one":
        loader, strategy, devices = (
            DataLoader(TensorDataset(x, y), batch_size=world_size * PER_RANK),
            "auto",
            1,
        )
    else:
        loader, strategy, devices = (
            shard(x, y, rank, world_size),
            ZeroStrategy(stage=stage),
            world_size,
        )
    saver = ModelCheckpoint(dirpath=f"{folder}/{stage}", every_n_train_steps=2, save_top_k=-1)
    model = make("cnn-adam")
    pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=4, logger=False,
               callbacks=[saver], enable_progress_bar=False, enable_model_summary=False,
               use_distributed_sampler=False).fit(model, loader)  # fmt: skip
    step2 = torch.load(f"{folder}/{stage}/epoch=0-step=2.ckpt", weights_only=False)
    resumed = make("cnn-adam")
    strategy = "auto" if stage == "one" else ZeroStrategy(stage=stage)
    trainer(strategy, devices, max_steps=4).fit(
        resumed, loader, ckpt_path=f"{folder}/{stage}/epoch=0-step=2.ckpt"
    )
    adam = step2["optimizer_states"][0]["state"]
    return {
        "fit": weights(model),
        "resumed": weights(resumed),
        "step2": [v.numpy().copy() for v in step2["state_dict"].values()],
        "adam": [
            adam[i][k].numpy().copy() for i in sorted(adam) for k in ("exp_avg", "exp_avg_sq")
        ],
    }


@pytest.mark.parametrize("stage", [1, 3])
def test_a_checkpoint_saved_mid_fit_is_one_processs_and_resumes_like_it(stage, tmp_path):
    """A checkpoint written while the shards are apart holds the whole weights and Adam's
    whole state in one process's numbering, and a fit resumed from it ends where one
    process's resumed from its own does (Lightning restarts a plain loader's epoch)."""
    (got, _) = run_on_ranks(_checkpointed, 2, str(tmp_path), stage, timeout=300)
    want = _checkpointed(0, 2, str(tmp_path), "one")
    for key in ("step2", "adam", "fit", "resumed"):
        assert len(got[key]) == len(want[key]), key
        assert_same(got[key], want[key], False, f"stage {stage}: {key}")


def _sharded(rank: int, world_size: int, folder: str, stage: int) -> dict:
    """Fit 4 steps writing sharded checkpoints every 2, then resume from the step-2 one."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    x, y = global_batches(world_size, steps=4)
    loader = shard(x, y, rank, world_size)
    saver = ModelCheckpoint(dirpath=f"{folder}/{stage}", every_n_train_steps=2, save_top_k=-1)
    model = make("cnn-adam")
    pl.Trainer(strategy=ZeroStrategy(stage=stage, checkpoint="sharded"), accelerator="cpu",
               devices=world_size, max_steps=4, logger=False, callbacks=[saver],
               enable_progress_bar=False, enable_model_summary=False,
               use_distributed_sampler=False).fit(model, loader)  # fmt: skip
    resumed = make("cnn-adam")
    step2 = f"{folder}/{stage}/epoch=0-step=2.ckpt"
    strategy = ZeroStrategy(stage=stage, checkpoint="sharded")
    trainer(strategy, world_size, max_steps=4).fit(resumed, loader, ckpt_path=step2)
    return {"fit": weights(model), "resumed": weights(resumed)}


@pytest.mark.parametrize("stage", [2, 3])
def test_a_sharded_checkpoint_resumes_and_consolidates_into_one_processs(stage, tmp_path):
    """``checkpoint="sharded"``: each rank writes only its shards (a folder, torch's
    distributed checkpoint); the fit resumes from it like one process from its own, and
    ``python -m lightning_par.zero consolidate`` makes one process's checkpoint of it."""
    from lightning_par.zero.__main__ import main

    got, _ = run_on_ranks(_sharded, 2, str(tmp_path), stage, timeout=300)
    want = _checkpointed(0, 2, str(tmp_path), "one")
    assert_same(got["fit"], want["fit"], False, f"stage {stage}: fit")
    assert_same(got["resumed"], want["resumed"], False, f"stage {stage}: resumed")
    folder = tmp_path / str(stage) / "epoch=0-step=2.ckpt"
    assert folder.is_dir() and main(["consolidate", str(folder), str(tmp_path / "whole.ckpt")]) == 0
    whole = torch.load(tmp_path / "whole.ckpt", weights_only=False)
    assert_same([v.numpy() for v in whole["state_dict"].values()], want["step2"], False, "weights")
    adam = whole["optimizer_states"][0]["state"]
    mine = [adam[i][k].numpy() for i in sorted(adam) for k in ("exp_avg", "exp_avg_sq")]
    assert_same(mine, want["adam"], False, "Adam's state")
    assert whole["global_step"] == 2 and whole["optimizer_states"][0]["param_groups"]


def _resume_elsewhere(rank: int, world_size: int, folder: str, stage: int) -> None:
    x, y = global_batches(world_size, steps=4)
    trainer(ZeroStrategy(stage=stage, checkpoint="sharded"), world_size, max_steps=4).fit(
        make("cnn-adam"), shard(x, y, rank, world_size), ckpt_path=folder
    )


def test_a_sharded_checkpoint_on_other_ranks_is_refused_with_the_way_out(tmp_path):
    from lightning_par.launch.run import RankFailed

    run_on_ranks(_sharded, 2, str(tmp_path), 3, timeout=300)
    folder = str(tmp_path / "3" / "epoch=0-step=2.ckpt")
    with pytest.raises(RankFailed) as err:
        run_on_ranks(_resume_elsewhere, 3, folder, 3, timeout=120)
    assert "written by 2 ranks, these are 3" in str(err.value)
    assert "python -m lightning_par.zero consolidate" in str(err.value)


def test_one_process_steps_the_whole_model_as_ring_allreduce_does():
    """One process (one GPU under ``make gpu-check``) has nothing to shard or send: every
    stage steps the whole model, the same bits as ``ring_allreduce`` on one process (stage
    1, whose gradients reach the optimizer's pieces after the allreduce, once skipped that
    where no allreduce ran, and never stepped), one process's weights to float tolerance
    (Lightning alone computes with its own thread count)."""
    x, y = global_batches(1)
    got = {}
    for strategy in ("ring_allreduce", ZeroStrategy(stage=1), ZeroStrategy(stage=2),
                     ZeroStrategy(stage=3)):  # fmt: skip
        model = make("cnn-adam")
        loader = DataLoader(TensorDataset(x, y), batch_size=PER_RANK)
        trainer(strategy, 1).fit(model, loader)
        got[getattr(strategy, "stage", "ring")] = weights(model)
    for stage in (1, 2, 3):
        assert_same(got[stage], got["ring"], True, f"stage {stage} vs ring_allreduce, 1 process")
    assert_same(got[1], one_process("cnn-adam", 1), False, "stage 1 vs one process")
