"""The layerwise Lightning strategy: same weights as one process (the CNN as the naive split,
the CifarRNN as the wavefront), per-stage bytes as the partition predicts, checkpoints that
load without the strategy, evaluation, and the configurations it refuses."""

from __future__ import annotations

import copy
import json
import re

import lightning.pytorch as pl
import pytest
import torch
from _split_models import loader as _loader
from _split_models import trainer as _trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_par.modelparallel.memory import predicted_param_bytes
from lightning_par.modelparallel.wavefront import wavefront_balance
from lightning_par.models import CifarCNN, CifarRNN
from lightning_par.pipeline.partition import balance_by_params, split_sequential
from lightning_par.strategies.layerwise import LayerwiseStrategy


def _model(kind: str) -> pl.LightningModule:
    torch.manual_seed(0)
    if kind == "cnn":
        return CifarCNN(width=8, num_blocks=2, scheduler=None)
    return CifarRNN(hidden_size=16, num_layers=3, scheduler=None)


@pytest.mark.parametrize(
    "kind, devices, kwargs",
    [
        ("cnn", 2, {}),  # the naive split, balanced by parameters
        ("cnn", 3, {"balance": [2, 1, 1]}),
        ("rnn", 2, {"time_chunk": 3}),  # 32 rows = 10 chunks of 3 + one of 2
        ("rnn", 3, {"time_chunk": 1}),  # one row per message
    ],
)
def test_weights_equal_single_process(kind, devices, kwargs):
    model = _model(kind)
    reference = copy.deepcopy(model)
    _trainer("auto", 1).fit(reference, _loader())
    _trainer(LayerwiseStrategy(**kwargs), devices).fit(model, _loader())
    expected, got = reference.state_dict(), model.state_dict()
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)


# SGD with momentum keeps one buffer per parameter; Adam two moments per parameter and a
# float32 step counter per tensor
OPTIMISER_BYTES = {
    "cnn": lambda params, tensors: params,
    "rnn": lambda params, tensors: 2 * params + 4 * tensors,
}


@pytest.mark.parametrize("kind, kwargs", [("cnn", {}), ("rnn", {"time_chunk": 4})])
def test_memory_per_stage_matches_partition(tmp_path, kind, kwargs):
    model = _model(kind)
    net = copy.deepcopy(model.net)
    strategy = LayerwiseStrategy(trace_dir=str(tmp_path), **kwargs)
    _trainer(strategy, 2, max_steps=1).fit(model, _loader())
    stages = json.loads((tmp_path / "memory.json").read_text())
    balance = wavefront_balance(net, 2) if kwargs else balance_by_params(net, 2)
    predicted = predicted_param_bytes(net, balance)
    assert [s["param_bytes"] for s in stages] == predicted
    assert [s["grad_bytes"] for s in stages] == predicted  # every parameter got a gradient
    for s, stage in zip(stages, split_counts(net, balance)):
        assert s["optimizer_bytes"] == OPTIMISER_BYTES[kind](s["param_bytes"], stage)
        assert s["activation_bytes"] > 0
    total = sum(p.numel() * p.element_size() for p in net.parameters())
    assert sum(predicted) == total
    assert max(predicted) < total  # no stage holds the whole model


def split_counts(net, balance) -> list[int]:
    return [len(list(stage.parameters())) for stage in split_sequential(net, balance)]


def test_checkpoint_loads_without_strategy_and_evaluates(tmp_path):
    model = _model("rnn")
    saver = ModelCheckpoint(dirpath=tmp_path, filename="lw", enable_version_counter=False)
    trainer = _trainer(LayerwiseStrategy(time_chunk=5), 3, callbacks=[saver])
    trainer.fit(model, _loader())
    loaded = CifarRNN.load_from_checkpoint(tmp_path / "lw.ckpt")
    for key, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value)
    ckpt = torch.load(tmp_path / "lw.ckpt", weights_only=False)
    # the optimiser state of the whole model, as one process's optimiser saves it
    groups = ckpt["optimizer_states"][0]["param_groups"]
    assert sum(len(g["params"]) for g in groups) == len(list(loaded.parameters()))
    evaluate = {"limit_val_batches": 1.0}
    reference = copy.deepcopy(loaded)
    expected = _trainer("auto", 1, **evaluate).validate(reference, _loader(), verbose=False)[0]
    got = _trainer(LayerwiseStrategy(time_chunk=7), 2, **evaluate).validate(
        loaded, _loader(), verbose=False
    )[0]
    assert got["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-5)
    assert got["val_acc"] == pytest.approx(expected["val_acc"])


@pytest.mark.parametrize(
    "kind, strategy, devices, message",
    [
        ("rnn", LayerwiseStrategy(time_chunk=2), 4, "4 stages but only 3 recurrent layers"),
        ("rnn", LayerwiseStrategy(time_chunk=2, balance=[4, 1]), 2, "no recurrent layer"),
        ("cnn", LayerwiseStrategy(time_chunk=2), 2, "needs recurrent layers"),
        ("cnn", LayerwiseStrategy(), 5, "5 devices (stages) but `net` has only 4"),
    ],
)
def test_bad_configurations_fail_before_launch(kind, strategy, devices, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _trainer(strategy, devices).fit(_model(kind), _loader())


def test_bad_arguments():
    with pytest.raises(ValueError, match="time_chunk must be an int >= 1"):
        LayerwiseStrategy(time_chunk=0)


def test_the_wavefront_needs_a_sequential_of_recurrent_layers():
    from lightning_par.models import ResNet18

    with pytest.raises(
        TypeError, match=r"time_chunk \(the wavefront\).*`ResNet18.net` is a ResNet"
    ):
        _trainer(LayerwiseStrategy(time_chunk=2), 2).fit(ResNet18(scheduler=None), _loader())
