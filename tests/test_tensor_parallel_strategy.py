"""The tensor_parallel Lightning strategy: same weights as one process (CNN, RNN, an MLP; world
2 and 3), checkpoints in one process's format both ways (save under it, load without it;
resume under it from a one-process checkpoint), and the configurations it refuses."""

from __future__ import annotations

import copy
import re

import lightning.pytorch as pl
import pytest
import torch
from _split_models import STEPS
from _split_models import loader as _loader
from _split_models import trainer as _trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from torch import nn

from lightning_par.comm.trace import load_traces
from lightning_par.compare.costs import tensor_parallel_bytes
from lightning_par.models import CifarCNN, CifarRNN, ImageClassifier
from lightning_par.strategies.tensor_parallel import TensorParallelStrategy
from lightning_par.tensorparallel import resolve_plan
from lightning_par.tensorparallel.cost import step_cost


class MLPClassifier(ImageClassifier):
    """Two Megatron MLP blocks (3072 -> 32 -> 16, 16 -> 16 -> 10): the second's input needs
    a gradient, so backward runs an ``f`` allreduce as well."""

    def __init__(self, optimizer: str = "sgd", lr: float = 0.05, momentum: float = 0.9,
                 weight_decay: float = 5e-4, scheduler: str | None = None) -> None:  # fmt: skip
        super().__init__(10, optimizer, lr, momentum, weight_decay, scheduler)
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(3072, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(),
            nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 10),
        )  # fmt: skip


class DivergentStart(MLPClassifier):
    """Ranks other than 0 start from other weights, as popen-launched ranks that each build
    their own model without a common seed: the strategy must cut rank 0's weights."""

    def setup(self, stage: str) -> None:  # runs in each rank before the strategy's setup
        if self.global_rank != 0:
            with torch.no_grad():
                for p in self.parameters():
                    p.add_(torch.randn_like(p))


def _model(kind: str, **kw) -> pl.LightningModule:
    torch.manual_seed(0)
    if kind == "cnn":
        return CifarCNN(width=16, num_blocks=2, scheduler=None)
    if kind == "rnn":
        return CifarRNN(hidden_size=12, num_layers=2, scheduler=None)
    if kind == "divergent":
        return DivergentStart()
    if kind == "dropout":  # a split activation's dropout (ShardedDropout) and a replicated one
        model = MLPClassifier()
        model.net[2] = nn.Dropout(0.3)
        model.net.append(nn.Dropout(0.2))
        return model
    return MLPClassifier(**kw)


def _assert_same(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize(
    "kind, devices", [("cnn", 2), ("rnn", 3), ("divergent", 3), ("dropout", 2), ("dropout", 3)]
)
def test_weights_equal_single_process(kind, devices):
    model = _model(kind)
    reference = copy.deepcopy(model) if kind != "divergent" else _model("mlp")
    pl.seed_everything(7)  # dropout: the same masks need the same seed (ranks: rank 0's)
    _trainer("auto", 1).fit(reference, _loader())
    strategy = TensorParallelStrategy()
    pl.seed_everything(7)
    _trainer(strategy, devices).fit(model, _loader())
    _assert_same(model.state_dict(), reference.state_dict())


def test_forkserver_ranks_start_from_the_main_process_state(monkeypatch):
    # forkserver: what the launch picks where fork is unsafe (a GPU machine after a backward
    # pass). The server keeps the environment it started with: one started before
    # seed_everything(7), here with another seed, must not reseed the ranks (their dropout
    # masks would differ from one process's, and so would the weights).
    import multiprocessing
    from multiprocessing import forkserver

    from lightning_par.launch.policy import FORKSERVER_PRELOAD

    forkserver._forkserver._stop()
    monkeypatch.setenv("PL_GLOBAL_SEED", "123")
    multiprocessing.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
    forkserver.ensure_running()
    monkeypatch.setenv("LIGHTNING_PAR_START_METHOD", "forkserver")
    model = _model("dropout")
    reference = copy.deepcopy(model)
    pl.seed_everything(7)
    _trainer("auto", 1).fit(reference, _loader())
    strategy = TensorParallelStrategy()
    pl.seed_everything(7)
    _trainer(strategy, 2).fit(model, _loader())
    assert strategy.launch_plan.method == "forkserver"
    _assert_same(model.state_dict(), reference.state_dict())


def test_checkpoints_are_one_process_format_both_ways(tmp_path):
    """One process trains 2 steps and saves; one process and tensor_parallel each resume from
    that checkpoint to 4 steps and save. The tensor_parallel checkpoint loads without the
    strategy and holds what the one-process one holds, weights and Adam state alike."""
    loader = lambda: _loader(size=20)  # noqa: E731 (two batches an epoch)
    first = _model("mlp", optimizer="adam", lr=1e-3)
    half = ModelCheckpoint(dirpath=tmp_path / "half", filename="half")
    _trainer("auto", 1, max_steps=2, callbacks=[half]).fit(first, loader())
    saved = {}
    for name, strategy, devices in [("one", "auto", 1), ("tp", TensorParallelStrategy(), 2)]:
        saver = ModelCheckpoint(dirpath=tmp_path / name, filename=name)
        model = _model("mlp", optimizer="adam", lr=1e-3)
        _trainer(strategy, devices, max_steps=4, callbacks=[saver]).fit(
            model, loader(), ckpt_path=tmp_path / "half" / "half.ckpt"
        )
        saved[name] = tmp_path / name / f"{name}.ckpt"
    loaded = MLPClassifier.load_from_checkpoint(saved["tp"])  # no strategy
    reference = MLPClassifier.load_from_checkpoint(saved["one"])
    _assert_same(loaded.state_dict(), reference.state_dict())
    assert not torch.equal(loaded.net[1].weight, first.net[1].weight)  # it did train on
    got = torch.load(saved["tp"], weights_only=False)["optimizer_states"][0]
    want = torch.load(saved["one"], weights_only=False)["optimizer_states"][0]
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for index, values in want["state"].items():
        for name, value in values.items():
            torch.testing.assert_close(got["state"][index][name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind, devices", [("mlp", 3), ("rnn", 2)])
def test_bytes_per_step_equal_the_cost_model(tmp_path, kind, devices):
    model = _model(kind)
    example = next(iter(_loader()))[0]
    _trainer(TensorParallelStrategy(trace_dir=tmp_path), devices).fit(model, _loader())
    plan = resolve_plan(_model(kind), devices)
    cost = step_cost(_model(kind), plan, example)
    # the compare report's model gives the same figures
    assert tensor_parallel_bytes(_model(kind), devices, 10, {}) == list(cost.bytes_sent)
    assert cost.max_bytes_sent > 0
    traces = load_traces(tmp_path)
    assert [t.rank for t in traces] == list(range(devices))
    for trace in traces:
        assert trace.bytes_sent == STEPS * cost.bytes_sent[trace.rank]
        assert trace.messages_sent == STEPS * cost.messages_sent[trace.rank]
        assert {m.tag.split("/")[0] for m in trace.messages} <= {"tp:f", "tp:g", "tp:gather",
                                                                "tp:reduce_scatter"}  # fmt: skip


def test_validation_after_fit_equals_one_process():
    evaluate = {"limit_val_batches": 1.0}
    model = _model("rnn")
    reference = copy.deepcopy(model)
    expected = _trainer("auto", 1, **evaluate).validate(reference, _loader(), verbose=False)[0]
    got = _trainer(TensorParallelStrategy(), 2, **evaluate).validate(
        model, _loader(), verbose=False
    )[0]
    assert got["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-5)
    assert got["val_acc"] == pytest.approx(expected["val_acc"])


@pytest.mark.parametrize(
    "kind, strategy, devices, trainer_kw, message",
    [
        ("cnn", TensorParallelStrategy(), 9, {}, "nothing in `CifarCNN.net` can be split over 9"),
        ("mlp", TensorParallelStrategy(plan={"net.1": "column"}), 2, {},
         "column layer 'net.1' must be followed"),
        ("mlp", TensorParallelStrategy(), 2, {"plugins": [MixedPrecision("16-mixed", "cpu")]},
         "a gradient scaler"),
        ("mlp", TensorParallelStrategy(), 2, {"sync_batchnorm": True}, "sync_batchnorm"),
    ],
)  # fmt: skip
def test_refused_before_launch(kind, strategy, devices, trainer_kw, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        _trainer(strategy, devices, **trainer_kw).fit(_model(kind), _loader())
    assert "tensor_parallel" in str(err.value)


class RankShiftedData(torch.utils.data.Dataset):
    """Each rank reads other images (as an unseeded shuffle under popen would give)."""

    def __init__(self) -> None:
        self.base = _loader().dataset

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        import torch.distributed as dist

        return self.base[(i + dist.get_rank()) % len(self.base)]


def test_different_batches_on_the_ranks_stop_the_run():
    loader = torch.utils.data.DataLoader(RankShiftedData(), batch_size=10)
    with pytest.raises(Exception, match="tensor_parallel: the ranks got different batches"):
        _trainer(TensorParallelStrategy(), 2).fit(_model("mlp"), loader)


def test_bad_arguments():
    with pytest.raises(ValueError, match="tensor_parallel: algorithm='butterfly'"):
        TensorParallelStrategy(algorithm="butterfly")
    with pytest.raises(TypeError, match="plan must be a dict"):
        TensorParallelStrategy(plan=["net.1"])


def test_registered_by_name():
    trainer = pl.Trainer(strategy="tensor_parallel", devices=2, accelerator="cpu", logger=False)
    assert isinstance(trainer.strategy, TensorParallelStrategy)
