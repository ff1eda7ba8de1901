"""One options dataclass behind gpipe, layerwise and hybrid's pipelines
(:mod:`lightning_par.components.pipeline_options`): the strategies' keywords are its fields
with its defaults, each builds it alike, and it refuses bad values when the strategy is made;
layerwise's ``time_chunk`` picks the wavefront's own splitter instead."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from torch import nn

from lightning_par.components.hybrid_kinds import KIND_OPTIONS, kind_option_names
from lightning_par.components.pipeline_options import (
    LAYERWISE,
    LAYERWISE_OPTIONS,
    PipelineOptions,
)
from lightning_par.components.wavefront_split import WavefrontSplit, layerwise_split
from lightning_par.pipeline.schedules import GPIPE, ONE_F_ONE_B
from lightning_par.strategies._base import ParStrategy
from lightning_par.strategies.gpipe import GPipeStrategy
from lightning_par.strategies.hybrid import HybridStrategy
from lightning_par.strategies.layerwise import LayerwiseStrategy


def _own_keywords(cls: type) -> dict[str, object]:
    """The keywords ``cls`` declares beyond ParStrategy's, with their defaults."""
    shared = set(inspect.signature(ParStrategy.__init__).parameters)
    return {
        name: p.default
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if name not in shared | {"self", "kwargs"}
    }


def test_gpipe_declares_every_option_with_the_dataclass_default():
    defaults = {f.name: f.default for f in dataclasses.fields(PipelineOptions)}
    assert _own_keywords(GPipeStrategy) == defaults
    assert list(_own_keywords(GPipeStrategy)) == list(PipelineOptions.names())


def test_layerwise_declares_its_options_and_fixes_the_rest():
    keywords = _own_keywords(LayerwiseStrategy)
    assert tuple(keywords) == LAYERWISE_OPTIONS
    # time_chunk (None: no wavefront) is the wavefront's, every other option the pipeline's
    defaults = {f.name: f.default for f in dataclasses.fields(PipelineOptions)}
    assert keywords == {name: defaults.get(name) for name in LAYERWISE_OPTIONS}
    assert set(LAYERWISE_OPTIONS) - set(defaults) == {"time_chunk"}
    split = LayerwiseStrategy(balance_by="time").splitter
    assert (split.chunks, split.checkpoint, split.schedule) == (1, "never", GPIPE)
    assert split.options == PipelineOptions(balance_by="time", **LAYERWISE)


def test_hybrid_offers_each_kinds_options():
    assert set(PipelineOptions.names()) <= set(KIND_OPTIONS)
    assert kind_option_names("gpipe") == list(PipelineOptions.names())
    assert kind_option_names("layerwise") == list(LAYERWISE_OPTIONS)
    grid = HybridStrategy(schedule="1f1b", chunks=2, loss_fn=nn.MSELoss()).splitter
    assert grid.options == PipelineOptions(schedule="1f1b", chunks=2, loss_fn=grid.loss_fn)
    rows = HybridStrategy(mp_kind="layerwise", split_points=["a"]).splitter
    assert rows.options == PipelineOptions(split_points=["a"], **LAYERWISE)
    wavefront = HybridStrategy(mp_kind="layerwise", time_chunk=3).splitter
    assert isinstance(wavefront, WavefrontSplit) and wavefront.time_chunk == 3


def test_the_strategy_hands_the_split_its_arguments_checked():
    loss = nn.CrossEntropyLoss()
    split = GPipeStrategy(
        balance=[1, 2], chunks=2, schedule="1f1b", module_attr="body", loss_attr="crit",
        balance_by="time", deferred_batch_norm=True, virtual_stages=3, loss_fn=loss,
        target_index="y",
    ).splitter  # fmt: skip
    assert split.options == PipelineOptions(
        balance=[1, 2], chunks=2, checkpoint="except_last", schedule=ONE_F_ONE_B,
        module_attr="body", loss_attr="crit", balance_by="time", deferred_batch_norm=True,
        virtual_stages=3, loss_fn=loss, target_index="y",
    )  # fmt: skip
    assert (split.balance, split.chunks, split.schedule, split.loss_fn) == (
        [1, 2],
        2,
        ONE_F_ONE_B,
        loss,
    )
    assert split.stages_per_device == 1  # virtual_stages counts under interleaved only


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"chunks": 0}, ValueError, "chunks (micro-batches per batch) must be an int >= 1"),
        ({"checkpoint": "sometimes"}, ValueError, "checkpoint='sometimes': choose one of"),
        ({"balance_by": "flops"}, ValueError, "balance_by='flops': choose one of"),
        ({"virtual_stages": True}, ValueError, "gpipe: virtual_stages must be an int >= 1"),
        ({"deferred_batch_norm": 1}, TypeError, "deferred_batch_norm must be True or False"),
        ({"split_points": "layer3"}, TypeError, "split_points must be a list of module names"),
        ({"split_points": ["a"], "balance": [1, 1]}, ValueError, "not both"),
        ({"loss_fn": 3}, TypeError, "loss_fn must be a callable"),
        ({"target_index": 1.5}, TypeError, "target_index must be an int"),
        ({"schedule": "zero_bubble", "checkpoint": "always"}, ValueError, "refuses checkpoint"),
    ],
)
def test_bad_values_are_refused_when_the_options_are_built(options, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        PipelineOptions(**options)


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"time_chunk": 0}, ValueError, "time_chunk must be an int >= 1 or None"),
        ({"split_points": ["a"], "time_chunk": 2}, ValueError, "not by split_points"),
        ({"split_points": "layer3"}, TypeError, "split_points must be a list of module names"),
        ({"balance_by": "flops"}, ValueError, "balance_by='flops': choose one of"),
    ],
)
def test_the_layerwise_split_refuses_bad_values_with_or_without_the_wavefront(
    options, error, message
):
    with pytest.raises(error, match=message):
        layerwise_split(**options)
