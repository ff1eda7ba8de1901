"""The optimisers a split model cannot step as one process does stop at setup, named, and the
others pass: each splitter's ``after_setup`` with a stand-in trainer (no processes). The
feature table (tests/test_features.py) runs LBFGS under every strategy."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_par.components.pipeline_split import PipelineSplit
from lightning_par.components.tensor_split import TensorParallelSplit

MATRIX = [nn.Parameter(torch.randn(4, 4))]  # Muon steps matrices only
OPTIMIZERS = {
    "SGD": lambda: torch.optim.SGD(MATRIX, lr=0.1),
    "AdamW": lambda: torch.optim.AdamW(MATRIX),
    "LBFGS": lambda: torch.optim.LBFGS(MATRIX),
    "Adafactor": lambda: torch.optim.Adafactor(MATRIX),
    "Muon": lambda: torch.optim.Muon(MATRIX),
}
#: splitter -> the optimisers it refuses: a stage holds whole tensors, a slice does not
LBFGS = "its line search takes norms and dot products over every parameter's gradient"
REFUSED = {
    PipelineSplit: {"LBFGS": LBFGS},
    TensorParallelSplit: {
        "LBFGS": LBFGS,
        "Adafactor": "second moment into row and column means",
        "Muon": "it orthogonalises each whole weight matrix",
    },
}


def set_up(split_cls: type, optimizer: torch.optim.Optimizer, strategy: str) -> None:
    split = split_cls()
    split.bind(SimpleNamespace(name=strategy, precision=Precision()))
    trainer = SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.FITTING), optimizers=[optimizer])
    split.after_setup(trainer)


@pytest.mark.parametrize("split_cls", list(REFUSED))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_split_refuses_what_reads_more_than_its_part_and_names_the_strategy(split_cls, name):
    if not hasattr(torch.optim, name):
        pytest.skip(f"torch {torch.__version__} has no {name}")
    optimizer = OPTIMIZERS[name]()
    if name not in REFUSED[split_cls]:
        set_up(split_cls, optimizer, "hybrid")
        return
    with pytest.raises(ValueError) as refusal:
        set_up(split_cls, optimizer, "hybrid")
    message = str(refusal.value)
    assert message.startswith(f"hybrid cannot run {name}: each rank steps the optimiser on ")
    assert REFUSED[split_cls][name] in message
    assert "Use an optimiser that updates each parameter from its own gradient" in message


def test_a_subclass_is_refused_as_its_base():
    class MyLBFGS(torch.optim.LBFGS):
        pass

    with pytest.raises(ValueError, match="gpipe cannot run MyLBFGS: .* for LBFGS"):
        set_up(PipelineSplit, MyLBFGS(MATRIX), "gpipe")
