"""``GPipeStrategy(schedule="interleaved" | "zero_bubble")`` and the hybrid grid's pipelines
under them: the same weights as one process (with clipping, accumulation, re-materialisation
and a checkpoint that loads without the strategy), and refusals before launch."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from _split_models import loader as _loader
from _split_models import trainer as _trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from test_hybrid import PRECISION
from test_hybrid import _assert_same_weights as assert_same_weights
from test_hybrid import _loader as hybrid_loader
from test_hybrid import _single_process as hybrid_reference

from lightning_par.models import CifarCNN
from lightning_par.strategies.gpipe import GPipeStrategy
from lightning_par.strategies.hybrid import HybridStrategy


def _model() -> pl.LightningModule:
    torch.manual_seed(0)
    return CifarCNN(width=8, num_blocks=2, scheduler=None)  # 4 layers: 2 devices x 2 stages


def _assert_close(got: dict, expected: dict, **tol) -> None:
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key].to(got[key].dtype), **tol, msg=key)


@pytest.mark.parametrize(
    "options, trainer_kw",
    [
        ({"schedule": "interleaved", "chunks": 4}, {}),  # v = 2 by default
        ({"schedule": "interleaved", "chunks": 2, "checkpoint": "always"},
         {"accumulate_grad_batches": 2}),
        ({"schedule": "zero_bubble", "chunks": 4}, {"accumulate_grad_batches": 2}),
        # clipping by norm hides a wrong gradient scale, so it gets a run of its own
        ({"schedule": "zero_bubble", "chunks": 2}, {"gradient_clip_val": 0.05}),
    ],
)  # fmt: skip
def test_new_schedules_train_like_one_process(tmp_path, options, trainer_kw):
    model = _model()
    reference = copy.deepcopy(model)
    _trainer("auto", 1, **trainer_kw).fit(reference, _loader())
    expected = reference.state_dict()
    saver = ModelCheckpoint(dirpath=tmp_path, filename="pipe", enable_version_counter=False)
    trainer = _trainer(GPipeStrategy(**options), 2, callbacks=[saver], **trainer_kw)
    trainer.fit(model, _loader())
    _assert_close(model.state_dict(), expected, rtol=1e-5, atol=1e-6)
    # the checkpoint holds the whole model, which loads without the strategy
    restored = CifarCNN.load_from_checkpoint(tmp_path / "pipe.ckpt", map_location="cpu")
    _assert_close(restored.state_dict(), expected, rtol=1e-5, atol=1e-6)


def test_hybrid_grid_of_interleaved_pipelines_trains_like_one_process():
    model = _model()
    expected = hybrid_reference(model, dp=2)
    strategy = HybridStrategy(dp=2, mp=2, schedule="interleaved", chunks=2)
    _trainer(strategy, 4, precision=PRECISION).fit(model, hybrid_loader(dp=2))
    assert_same_weights(model.state_dict(), expected)


def test_unsupported_combinations_are_refused_before_launch():
    refused = r"gpipe: schedule='zero_bubble' refuses checkpoint='always'.*checkpoint='never'"
    with pytest.raises(ValueError, match=refused):
        GPipeStrategy(schedule="zero_bubble", checkpoint="always")
    with pytest.raises(ValueError, match="gpipe: virtual_stages must be an int >= 1, got 0"):
        GPipeStrategy(schedule="interleaved", virtual_stages=0)
    with pytest.raises(ValueError, match=r"schedule='zigzag': choose one of .*'zero_bubble'"):
        GPipeStrategy(schedule="zigzag")
    # found in the main process, before any rank starts
    trainer = _trainer(GPipeStrategy(schedule="interleaved", chunks=3), 2)
    refused = r"gpipe: schedule='interleaved' needs chunks to be a multiple of the 2 devices"
    with pytest.raises(ValueError, match=refused + ".*use chunks=4 or 2"):
        trainer.fit(_model(), _loader())
    trainer = _trainer(GPipeStrategy(schedule="interleaved", virtual_stages=3), 2)
    with pytest.raises(ValueError, match=r"6 stages \(2 devices x 3 virtual stages\) but `net` "
                                         r"has only 4 layers"):  # fmt: skip
        trainer.fit(_model(), _loader())


@pytest.mark.parametrize("schedule", ["interleaved", "zero_bubble"])
def test_validation_runs_the_stages_forwards_only_like_one_process(schedule):
    model = _model()
    evaluate = {"limit_val_batches": 1.0}
    expected = _trainer("auto", 1, **evaluate).validate(copy.deepcopy(model), _loader(),
                                                         verbose=False)[0]  # fmt: skip
    strategy = GPipeStrategy(schedule=schedule, chunks=2)
    got = _trainer(strategy, 2, **evaluate).validate(model, _loader(), verbose=False)[0]
    assert got["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-5)
    assert got["val_acc"] == pytest.approx(expected["val_acc"])
