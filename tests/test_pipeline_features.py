"""What the pipeline strategies do so that everyday features mean what they mean in one
process: clipping by the whole model's norm, one loss scale, the same batch on every stage,
a BatchNorm warning, and the optimiser state in one process's format."""

from __future__ import annotations

import pytest
import torch
from _feature_cells import Tiny, _weights, make_trainer
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_par.comm import RankFailed, run_on_ranks
from lightning_par.components.pipeline_features import (
    agree_on_overflow,
    clip_grad_norm_across_stages,
)
from lightning_par.pipeline.batchnorm import DeferredBatchNorm
from lightning_par.pipeline.optim_state import merge_stage_states, model_order, stage_state
from lightning_par.strategies.gpipe import GPipeStrategy


def _clip(rank: int, world: int) -> dict:
    """Stage r holds layer r; both hold ``shared``; the reference clips all in one process."""
    torch.manual_seed(0)
    layers = [nn.Linear(3, 5), nn.Linear(5, 2)]
    shared = nn.Parameter(torch.ones(2))
    whole = [*layers[0].parameters(), *layers[1].parameters(), shared]
    for p in whole:
        p.grad = torch.randn_like(p) * 3
    ref = [nn.Parameter(p.detach().clone()) for p in whole]
    for r, p in zip(ref, whole):
        r.grad = p.grad.clone()
    torch.nn.utils.clip_grad_norm_(ref, 1.0)
    mine = list(layers[rank].parameters())
    clip_grad_norm_across_stages(mine, 1.0, shared_params=[shared], count_shared=rank == 0)
    start = 0 if rank == 0 else 2
    return {
        "stage": [torch.allclose(p.grad, r.grad, atol=1e-6) for p, r in zip(mine, ref[start:])],
        "shared": torch.allclose(shared.grad, ref[-1].grad, atol=1e-6),
    }


def test_clipping_by_norm_uses_every_stages_gradients_once():
    for out in run_on_ranks(_clip, 2, timeout=30):
        assert all(out["stage"]) and out["shared"], out


def _overflow(rank: int, world: int) -> dict:
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))  # creates the scale
    p.grad = torch.full((3,), float("inf") if rank == 1 else 1.0)  # only stage 1 overflows
    agree_on_overflow(scaler)
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    return {"stepped": not torch.equal(p.detach(), torch.ones(3)), "scale": scaler.get_scale()}


def test_stages_skip_the_same_steps_and_keep_one_loss_scale():
    results = run_on_ranks(_overflow, 2, timeout=30)
    assert [r["stepped"] for r in results] == [False, False]
    assert [r["scale"] for r in results] == [512.0, 512.0]


class _UnseededShuffle(Tiny):
    """Each stage shuffles with its own seed, as an unseeded shuffle under popen would."""

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(100 + self.global_rank)
        data = TensorDataset(torch.randn(16, 4), torch.randint(0, 3, (16,)))
        return DataLoader(data, batch_size=8, shuffle=True, generator=g)


def _different_batches(rank: int, world: int) -> None:
    torch.manual_seed(0)
    make_trainer(GPipeStrategy(chunks=2), 2, "none", "").fit(_UnseededShuffle("none"))


def test_stages_with_different_batches_stop_at_the_first_naming_the_stage():
    with pytest.raises(RankFailed, match=r"gpipe: pipeline stage\(s\) \[1\] received a different"):
        run_on_ranks(_different_batches, 2, timeout=30)


def test_batchnorm_under_micro_batches_warns_before_launch():
    model = Tiny("batchnorm")
    trainer = make_trainer(GPipeStrategy(chunks=4), 2, "batchnorm", "")
    with pytest.warns(UserWarning, match="each micro-batch is normalised with its own"):
        trainer.strategy._lightning_module = model
        trainer.strategy.check_before_launch(trainer)


def test_stage_optimiser_states_merge_into_one_process_format_and_back():
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {"a": nn.Linear(2, 2), "net": nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))}
    )
    named = dict(model.named_parameters())
    groups = [["a.weight", "net.0.weight", "net.1.weight"], ["a.bias", "net.0.bias", "net.1.bias"]]
    full_opt = torch.optim.Adam([{"params": [named[n] for n in g]} for g in groups], lr=0.1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    full_opt.step()
    full = full_opt.state_dict()
    # stage 0 holds net.0, stage 1 net.1; both hold "a" (owned by the module itself)
    stage_groups = [
        [["a.weight", "net.0.weight"], ["a.bias", "net.0.bias"]],
        [["a.weight", "net.1.weight"], ["a.bias", "net.1.bias"]],
    ]
    stage_names = [
        ["a.weight", "a.bias", "net.0.weight", "net.0.bias"],
        ["a.weight", "a.bias", "net.1.weight", "net.1.bias"],
    ]
    order = model_order(stage_names, "net.")
    assert order == list(named)
    parts = [stage_state(full, s, stage_groups, order) for s in range(2)]
    assert torch.equal(parts[1]["state"][1]["exp_avg"], full["state"][2]["exp_avg"])  # net.1.weight
    merged = merge_stage_states(parts, stage_groups, order)
    assert merged["param_groups"] == full["param_groups"]
    for i, state in full["state"].items():
        torch.testing.assert_close(merged["state"][i], state)
    with pytest.raises(ValueError, match="saved for another model"):
        stage_state(full, 0, [[["a.weight"], []], [["net.1.weight"], []]], order)


def test_deferred_batch_norm_tracks_the_whole_mini_batch_and_ignores_recomputation():
    torch.manual_seed(0)
    x = torch.randn(12, 3, 5) * 4 + 2
    whole = nn.BatchNorm1d(3, momentum=0.3)
    whole(x)
    deferred = DeferredBatchNorm.from_batch_norm(nn.BatchNorm1d(3, momentum=0.3))
    plain = nn.BatchNorm1d(3, momentum=0.3)
    for part in x.chunk(4):
        out = checkpoint(deferred, part.requires_grad_(), use_reentrant=False)
        out.sum().backward()  # re-runs the forward inside backward: not counted again
        torch.testing.assert_close(out, plain(part))  # normalised per micro-batch
    deferred.commit()
    torch.testing.assert_close(deferred.running_mean, whole.running_mean)
    torch.testing.assert_close(deferred.running_var, whole.running_var)
    assert int(deferred.num_batches_tracked) == 1
    assert set(deferred.state_dict()) == set(whole.state_dict())  # checkpoints unchanged


@pytest.mark.parametrize("deferred", [True, False])
def test_gpipe_running_statistics_equal_one_process_with_deferred_batch_norm(deferred):
    expected = Tiny("batchnorm")
    expected.shards = False
    make_trainer("auto", 1, "batchnorm", "", max_steps=1).fit(expected)
    model = Tiny("batchnorm")
    model.shards = False  # every stage reads the whole batch
    strategy = GPipeStrategy(chunks=4, deferred_batch_norm=deferred)
    make_trainer(strategy, 2, "batchnorm", "", max_steps=1).fit(model)
    got, want = model.net[1], expected.net[1]  # after one step: the same inputs reached it
    same = torch.allclose(got.running_var, want.running_var, atol=1e-6) and torch.allclose(
        got.running_mean, want.running_mean, atol=1e-6
    )
    assert same == deferred


class _FrozenFirstStage(Tiny):
    """The first stage all frozen, and an optimiser of the trainable parameters only."""

    def __init__(self) -> None:
        super().__init__("none")
        self.net[0].requires_grad_(False)
        self.shards = False

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def _frozen_first_stage(rank: int, world: int) -> dict:
    trainer = make_trainer(GPipeStrategy(balance=[2, 3]), 2, "none", "")
    model = _FrozenFirstStage()
    trainer.fit(model)
    return _weights(trainer, model)


def test_a_stage_whose_layers_are_all_frozen_trains_like_one_process():
    # every device's optimiser lists the whole model's trainable parameters (the network
    # stays whole, what other devices hold is emptied), so none is left empty
    got = run_on_ranks(_frozen_first_stage, 2, timeout=60)[0]
    expected = _FrozenFirstStage()
    trainer = make_trainer("auto", 1, "none", "")
    trainer.fit(expected)
    want = _weights(trainer, expected)
    assert got.keys() == want.keys()
    for key in want:
        assert abs(got[key] - want[key]).max() < 1e-6, key
    assert (got["net.0.weight"] == Tiny("none").net[0].weight.detach().numpy()).all()
