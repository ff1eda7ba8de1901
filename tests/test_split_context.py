"""A model splitter reads its strategy only through a ``SplitContext``: bound to a plain
object holding the context's names and nothing else, the pipeline and wavefront splitters
check a network before launch as they do under their strategies."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_par.components.pipeline_options import PipelineOptions
from lightning_par.components.pipeline_split import PipelineSplit
from lightning_par.components.splitter import SplitContext
from lightning_par.components.wavefront_split import WavefrontSplit
from lightning_par.modelparallel import stacked_rnn


class Context:
    """The names of :class:`SplitContext`, before setup (no communicator yet)."""

    def __init__(self, module: pl.LightningModule, size: int, name: str,
                 sync_batchnorm: bool = False) -> None:  # fmt: skip
        self.name, self.module, self.size, self.sync_batchnorm = name, module, size, sync_batchnorm
        self.comm, self.rank, self.devices, self.root_device = None, 0, [], torch.device("cpu")
        self.precision, self.backend = None, None

    def broadcast(self, obj):
        return obj


class Holder(pl.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net


def _context_names() -> set[str]:
    return {n for n in vars(SplitContext) if not n.startswith("_")}


def test_the_stub_holds_exactly_the_contexts_names():
    context = Context(Holder(nn.Linear(2, 2)), 2, "gpipe")
    assert {n for n in dir(context) if not n.startswith("_")} == _context_names()


def test_the_pipeline_split_checks_a_network_through_its_context():
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    split = PipelineSplit(PipelineOptions(chunks=2))
    split.bind(Context(Holder(net), 2, "gpipe"))
    split.check_before_launch(None)  # two stages of three layers: fine
    split.bind(Context(Holder(net), 4, "gpipe"))
    with pytest.raises(ValueError, match=r"4 devices \(stages\) but `net` has only 3 layers"):
        split.check_before_launch(None)
    split.bind(Context(Holder(net), 2, "hybrid", sync_batchnorm=True))
    with pytest.raises(ValueError, match="hybrid refuses sync_batchnorm=True"):
        split.check_before_launch(None)


def test_the_wavefront_split_checks_a_network_through_its_context():
    split = WavefrontSplit(time_chunk=2)
    split.bind(Context(Holder(stacked_rnn("lstm", [4, 8, 8])), 2, "layerwise"))
    split.check_before_launch(None)  # one recurrent layer per stage: fine
    split.bind(Context(Holder(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))), 2, "layerwise"))
    with pytest.raises(ValueError, match="needs recurrent layers"):
        split.check_before_launch(None)
    split.bind(Context(Holder(nn.Linear(4, 2)), 2, "layerwise"))
    with pytest.raises(TypeError, match=r"layerwise: time_chunk \(the wavefront\)"):
        split.check_before_launch(None)
