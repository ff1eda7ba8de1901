"""The gpipe Lightning strategy: same weights as one process, evaluation, checkpoints that
load without the strategy, traces, and clear errors for configurations it cannot run."""

from __future__ import annotations

import copy
import json
import re

import lightning.pytorch as pl
import pytest
import torch
from _split_models import loader as _loader
from _split_models import trainer as _trainer
from lightning.pytorch.callbacks import BasePredictionWriter, ModelCheckpoint
from torch import nn

from lightning_par.models import CifarCNN, CifarRNN
from lightning_par.strategies.gpipe import GPipeStrategy


def _model(kind: str) -> pl.LightningModule:
    torch.manual_seed(0)
    if kind == "cnn":
        return CifarCNN(width=8, num_blocks=2, scheduler=None)
    return CifarRNN(hidden_size=16, num_layers=2, scheduler=None)


def _saver(tmp_path) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=tmp_path, filename="pipe", enable_version_counter=False)


class _Writer(BasePredictionWriter):
    def __init__(self, path):
        super().__init__(write_interval="epoch")
        self.path = path

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        if trainer.is_global_zero:
            torch.save(torch.cat(predictions), self.path)


def _single_process(model: pl.LightningModule) -> dict[str, torch.Tensor]:
    reference = copy.deepcopy(model)
    _trainer("auto", 1).fit(reference, _loader())
    return reference.state_dict()


@pytest.mark.parametrize(
    "kind, devices, kwargs",
    [
        ("cnn", 1, {"chunks": 4, "checkpoint": "always"}),  # one stage: micro-batches only
        ("cnn", 2, {}),  # defaults: auto balance, chunks=4 (uneven: 10 = 3+3+2+2), except_last
        ("cnn", 3, {"chunks": 1, "checkpoint": "never"}),  # the naive split
        ("cnn", 4, {"chunks": 3, "schedule": "1f1b", "checkpoint": "always"}),
        ("rnn", 2, {"chunks": 4, "schedule": "1f1b", "balance": [2, 2]}),
        ("rnn", 3, {"chunks": 2, "checkpoint": "always"}),
    ],
)
def test_weights_equal_single_process(kind, devices, kwargs):
    model = _model(kind)
    expected = _single_process(model)
    _trainer(GPipeStrategy(**kwargs), devices).fit(model, _loader())
    # the launcher hands the FULL model back to this process, as a plain nn.Sequential
    assert isinstance(model.net, nn.Sequential)
    got = model.state_dict()
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)


def test_registered_name_with_defaults_trains(tmp_path):
    model = _model("cnn")
    trainer = _trainer("gpipe", 2, default_root_dir=tmp_path, enable_checkpointing=True)
    trainer.fit(model, _loader())
    assert isinstance(trainer.strategy, GPipeStrategy)
    assert torch.isfinite(trainer.callback_metrics["train_loss"])


def test_validate_test_predict_and_checkpoint(tmp_path):
    model = _model("cnn")
    strategy = GPipeStrategy(chunks=3, trace_dir=str(tmp_path / "trace"))
    trainer = _trainer(strategy, 2, callbacks=[_saver(tmp_path)])
    trainer.fit(model, _loader())  # 3 steps = one epoch; the callback saves inside the ranks
    path = tmp_path / "pipe.ckpt"
    # loads WITHOUT the strategy, and equals the model handed back after fit
    loaded = CifarCNN.load_from_checkpoint(path)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value)
    ckpt = torch.load(path, weights_only=False)
    # the optimiser state of the whole model, as one process's optimiser saves it
    groups = ckpt["optimizer_states"][0]["param_groups"]
    assert sum(len(g["params"]) for g in groups) == len(list(loaded.parameters()))

    reference = copy.deepcopy(loaded)
    evaluate = {"limit_val_batches": 1.0, "limit_test_batches": 1.0}
    expected = _trainer("auto", 1, **evaluate).validate(reference, _loader(), verbose=False)[0]
    x = torch.cat([b[0] for b in _loader()])
    # predictions come back through a writer (fork launchers do not return predictions)
    writer = _Writer(tmp_path / "pred.pt")
    _trainer(GPipeStrategy(chunks=3), 2, callbacks=[writer]).predict(loaded, _loader())
    predicted = torch.load(tmp_path / "pred.pt")
    got = _trainer(GPipeStrategy(chunks=2), 2, **evaluate).validate(
        loaded, _loader(), verbose=False
    )
    tested = _trainer(GPipeStrategy(chunks=4), 2, **evaluate).test(loaded, _loader(), verbose=False)
    got, tested = got[0], tested[0]
    assert got["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-5)
    assert got["val_acc"] == pytest.approx(expected["val_acc"])
    assert tested["test_loss"] == pytest.approx(expected["val_loss"], rel=1e-5)
    with torch.no_grad():
        assert torch.equal(predicted, reference.net(x).argmax(dim=1))

    # the trace: every stage recorded forwards/backwards and its messages
    traces = [json.loads((tmp_path / "trace" / f"rank{r}.json").read_text()) for r in range(2)]
    for record in traces:
        names = {e["name"] for e in record["events"]}
        assert {"fwd", "bwd", "step"} <= names
    assert {m["tag"] for m in traces[0]["messages"]} >= {"act", "grad", "output"}


def test_resume_from_checkpoint_continues_like_one_run(tmp_path):
    # Compared with an uninterrupted pipeline run rather than with one process: a 1e-8
    # difference in the weights after two steps already moves this CNN's third-step
    # gradients by 1e-4 (ReLU kinks), while a lost momentum buffer moves them far more.
    model = _model("cnn")
    uninterrupted = copy.deepcopy(model)
    _trainer(GPipeStrategy(chunks=2), 2).fit(uninterrupted, _loader(size=20))  # batches 0, 1, 0
    first = _trainer(GPipeStrategy(chunks=2), 2, max_steps=2, callbacks=[_saver(tmp_path)])
    first.fit(model, _loader(size=20))
    resumed = _model("cnn")
    ckpt = tmp_path / "pipe.ckpt"
    _trainer(GPipeStrategy(chunks=2), 2).fit(resumed, _loader(size=20), ckpt_path=ckpt)
    for key, value in uninterrupted.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value, rtol=0, atol=1e-7)


class _NotSequential(CifarCNN):
    def __init__(self):
        super().__init__(width=8, num_blocks=2)
        self.net = nn.ModuleList(list(self.net))


@pytest.mark.parametrize(
    "model, strategy, devices, message",
    [
        (_NotSequential, GPipeStrategy(), 2, "a ModuleList without a forward of its own"),
        (lambda: _model("cnn"), GPipeStrategy(module_attr="body"), 2, ".body` is not an nn.Module"),
        (
            lambda: _model("cnn"),
            GPipeStrategy(balance=[2, 3]),
            2,
            "sums to 5 but the network has 4",
        ),
        (lambda: _model("cnn"), GPipeStrategy(balance=[1, 1, 2]), 2, "3 stages but there are 2"),
        (lambda: _model("rnn"), GPipeStrategy(), 5, "5 devices (stages) but `net` has only 4"),
        (
            lambda: _model("rnn"),
            GPipeStrategy(),
            4,
            "stage 0 of balance [1, 1, 1, 1] (ImageToRows)",
        ),
    ],
)
def test_bad_configurations_fail_before_launch(model, strategy, devices, message):
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        _trainer(strategy, devices).fit(model(), _loader())


def test_bad_arguments():
    with pytest.raises(ValueError, match="schedule='zb'"):
        GPipeStrategy(schedule="zb")
    with pytest.raises(ValueError, match="checkpoint='sometimes'"):
        GPipeStrategy(checkpoint="sometimes")
    with pytest.raises(ValueError, match="chunks"):
        GPipeStrategy(chunks=0)
    model = _model("cnn")
    model.criterion = nn.CrossEntropyLoss(reduction="sum")
    with pytest.raises(TypeError, match="mean-reduced"):
        _trainer(GPipeStrategy(schedule="1f1b"), 2).fit(model, _loader())


def test_more_micro_batches_than_samples():
    with pytest.raises(Exception, match="chunks=16 micro-batches but the batch has 10 samples"):
        _trainer(GPipeStrategy(chunks=16), 2).fit(_model("cnn"), _loader())
