"""ParameterServerStrategy under Lightning: exact as one process, checkpoints, trace, refusals."""

from __future__ import annotations

from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par.models import CifarCNN, CifarRNN
from lightning_par.strategies.parameter_server import ParameterServerStrategy

PER_WORKER, STEPS = 4, 4


def data(n: int):
    g = torch.Generator().manual_seed(5)
    return TensorDataset(
        torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
    )


class ShardedData:
    """Each worker reads its slice of every global batch of ``global_batch`` samples, so the
    workers' batches together are exactly one process's batch (as in the allreduce tests).
    Two batches per epoch (the resume test relies on it)."""

    global_batch = 2 * PER_WORKER

    def train_dataloader(self):
        world, rank = self.trainer.world_size, self.global_rank
        per, full = self.global_batch // world, data(STEPS * self.global_batch)
        index = torch.cat([torch.arange(i * self.global_batch + rank * per,
                                        i * self.global_batch + (rank + 1) * per)
                           for i in range(STEPS // 2)])  # fmt: skip
        return DataLoader(TensorDataset(*full[index]), batch_size=per)


class CNN(ShardedData, CifarCNN):
    pass


class RNN(ShardedData, CifarRNN):
    pass


def make(
    kind: str, workers: int = 2, scheduler: str | None = "onecycle", width: int = 8
) -> pl.LightningModule:
    torch.manual_seed(0)
    if kind == "cnn":
        model = CNN(width=width, num_blocks=2, scheduler=scheduler, lr=0.05)
    else:
        model = RNN(hidden_size=16, num_layers=2, optimizer="adam", scheduler="onecycle", lr=0.01)
    model.global_batch = workers * PER_WORKER
    return model


def fit(model, strategy, devices: int, steps: int = STEPS, ckpt_path=None, **kw) -> pl.Trainer:
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=kw.pop("enable_checkpointing", False),
        use_distributed_sampler=False, **kw,
    )  # fmt: skip
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def weights(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("kind,workers,servers", [("cnn", 2, 2), ("rnn", 3, 1)])
def test_equals_one_process_with_scheduler(kind, workers, servers):
    reference = make(kind, workers)
    fit(reference, "auto", 1)
    model = make(kind, workers)
    strategy = ParameterServerStrategy(num_servers=servers, bucket_cap_mb=0.01, split_mb=0.005)
    fit(model, strategy, workers)
    torch.testing.assert_close(weights(model), weights(reference), atol=2e-5, rtol=1e-4)
    assert not torch.equal(weights(model), weights(make(kind, workers)))  # it did train


def test_pushes_start_before_backward_ends():
    # a CNN whose backward lasts long enough (tens of ms) that a loaded machine still
    # schedules the communication thread while it runs
    strategy = ParameterServerStrategy(num_servers=1, bucket_cap_mb=0.05, trace=True)
    fit(make("cnn", width=32), strategy, 2, steps=2)
    trace = strategy.trace  # rank 0's, sent back to this process
    backward = [e for e in trace.events if e.name == "backward"]
    pushes = [m for m in trace.messages if m.tag == "push" and m.step == 1]
    assert len({m.chunk for m in pushes}) > 1  # several buckets
    assert min(m.start for m in pushes) < backward[1].end  # the first push overlaps backward


def test_checkpoint_holds_full_model_and_optimiser_state(tmp_path):
    first = make("cnn", scheduler=None)
    trainer = fit(first, ParameterServerStrategy(num_servers=2, split_mb=0.005), 2,
                  steps=2, default_root_dir=tmp_path, enable_checkpointing=True)  # fmt: skip
    path = trainer.checkpoint_callback.best_model_path
    saved = torch.load(path, weights_only=False)
    state = saved["optimizer_states"][0]["state"]
    params = list(first.parameters())
    assert len(state) == len(params)  # every parameter's state, gathered from both servers
    for s, p in zip(state.values(), params):
        assert s["momentum_buffer"].shape == p.shape and s["momentum_buffer"].abs().sum() > 0
    loaded = CifarCNN.load_from_checkpoint(path)  # loads without the strategy
    torch.testing.assert_close(weights(loaded), weights(first))


class Halving(CNN):
    """A scheduler that changes the learning rate every step and has no fixed length, so a
    two-step run and a three-step run schedule the same rates."""

    def configure_optimizers(self):
        hp = self.hparams
        if hp.optimizer == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=hp.lr, momentum=0.9, weight_decay=1e-3)
        else:
            opt = torch.optim.Adam(self.parameters(), lr=hp.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_resume_from_checkpoint_equals_an_uninterrupted_run(tmp_path, optimizer):
    # Three steps over two batches per epoch: the uninterrupted run reads batches 0, 1, 0.
    # The checkpoint is written at the end of epoch 0 (step 2), which Lightning counts as
    # mid-epoch; its loader is not resumable, so the resumed run's third step reads a fresh
    # iterator's batch 0: the same batch. (With four steps the resumed run would read
    # batch 0 twice, which is what made an earlier version of this test differ by 0.06, as
    # much in one process as here.) Compared with an uninterrupted run on the strategy,
    # like the gpipe test: the servers' momentum/Adam state, Adam's step count and the
    # scheduled rate must all come back for the third step to match.
    def model():
        torch.manual_seed(0)
        m = Halving(width=8, num_blocks=2, optimizer=optimizer, lr=0.05)
        m.global_batch = 2 * PER_WORKER
        return m

    def strategy():
        return ParameterServerStrategy(num_servers=2, bucket_cap_mb=0.01, split_mb=0.005)

    uninterrupted = model()
    fit(uninterrupted, strategy(), 2, steps=3)
    first = fit(model(), strategy(), 2, steps=2, default_root_dir=tmp_path / "a",
                enable_checkpointing=True)  # fmt: skip
    path = first.checkpoint_callback.best_model_path
    assert "step=2" in path
    resumed = model()
    fit(resumed, strategy(), 2, steps=3, ckpt_path=path, default_root_dir=tmp_path / "b")
    torch.testing.assert_close(weights(resumed), weights(uninterrupted), rtol=0, atol=1e-7)
    # and the third step did move the weights (a resume that trained nothing would fail)
    assert not torch.allclose(weights(resumed), weights(CifarCNN.load_from_checkpoint(path)))


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="num_servers"):
        ParameterServerStrategy(num_servers=0)
    with pytest.raises(TypeError, match="num_servers"):
        ParameterServerStrategy(num_servers=1.5)
    with pytest.raises(ValueError, match="gloo"):
        ParameterServerStrategy(process_group_backend="nccl")
    with pytest.raises(ValueError, match="parameter_server refuses precision='16-mixed'"):
        fit(make("cnn"), ParameterServerStrategy(), 2, plugins=[MixedPrecision("16-mixed", "cpu")])


class PreparesData(CNN):
    def prepare_data(self):  # Lightning then puts a barrier around it, in a new group
        pass


def test_prepare_data_does_not_wait_for_the_servers():
    # Lightning's barrier around prepare_data spans every rank of the default group; the
    # servers never enter it, so it must be the workers' (this hung the check's rows)
    torch.manual_seed(0)
    model = PreparesData(width=8, num_blocks=2, scheduler=None)
    strategy = ParameterServerStrategy(num_servers=1, timeout=timedelta(seconds=20))
    before = weights(model).clone()
    fit(model, strategy, 2, steps=1)
    assert not torch.equal(weights(model), before)  # it trained (weights came back)
