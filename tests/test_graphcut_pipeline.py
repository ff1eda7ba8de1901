"""Networks no one here wrote, cut by ``graphcut`` and trained by the pipeline runtime on
several processes under every schedule: the weights after SGD steps equal one process's on
the whole batch (torchvision's ResNet-18 with GroupNorm; Lightning's demo Transformer, whose
two inputs and masks cross the cut as a tuple). The stage interface the two share: a stage
maps a tuple of tensors to a tuple of tensors (``pipeline/multistage.py``)."""

from __future__ import annotations

import pytest
import torch
import torchvision
from lightning.pytorch.demos import Transformer
from torch import nn

from lightning_par.comm import Communicator, run_on_ranks
from lightning_par.graphcut import split_module
from lightning_par.pipeline.multistage import DeviceStages
from lightning_par.pipeline.step import scheduled_step

BATCH, CHUNKS, STEPS = 8, 4, 2


def build(name: str):
    """(model, batch inputs, targets, loss, split points) with the same weights every call."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "resnet18":
        model = torchvision.models.resnet18(num_classes=5, norm_layer=lambda c: nn.GroupNorm(4, c))
        x = (torch.randn(BATCH, 3, 32, 32, generator=g),)
        return (
            model,
            x,
            torch.randint(0, 5, (BATCH,), generator=g),
            nn.CrossEntropyLoss(),
            ["layer3"],
        )
    model = Transformer(vocab_size=30, ninp=16, nhead=2, nhid=16, nlayers=1, dropout=0.0)
    src, tgt = (torch.randint(0, 30, (BATCH, 6), generator=g) for _ in range(2))
    return (
        model,
        (src, tgt),
        torch.randint(0, 30, (BATCH * 6,), generator=g),
        nn.NLLLoss(),
        ["transformer"],
    )


def one_process(name: str) -> dict[str, torch.Tensor]:
    model, x, y, loss_fn, _ = build(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(STEPS):
        opt.zero_grad()
        loss_fn(model(*x), y).backward()
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


#: interleaved: two stages per device, dealt round-robin (device 0 holds stages 0 and 2)
INTERLEAVED_POINTS = {"resnet18": ["layer2", "layer3", "layer4"]}


def _pipelined(rank, world, name, schedule):
    model, x, y, loss_fn, points = build(name)
    virtual = 2 if schedule == "interleaved" else 1
    points = INTERLEAVED_POINTS[name] if virtual == 2 else points
    micro = tuple(t[: BATCH // CHUNKS] for t in x)  # stages are traced at the micro-batch shape
    split = split_module(model, micro, points)
    mine = {s: split.stages[s].module for s in range(world * virtual) if s % world == rank}
    device = DeviceStages(
        mine, world * virtual, Communicator(), split_backward=schedule == "zero_bubble"
    )
    stage = nn.ModuleList(mine.values())
    opt = torch.optim.SGD(stage.parameters(), lr=0.05, momentum=0.9)
    targets = y.view(CHUNKS, -1) if name != "resnet18" else y
    for _ in range(STEPS):
        opt.zero_grad()
        if name == "resnet18":
            scheduled_step(device, x, y, loss_fn, CHUNKS, schedule, virtual)
        else:  # the demo's output is [B * T, vocab]: its targets split by sequence
            scheduled_step(
                device, x, targets, lambda out, t: loss_fn(out, t.reshape(-1)), CHUNKS, schedule
            )
        opt.step()
    return {k: v.detach() for m in mine.values() for k, v in m.named_parameters()}


@pytest.mark.parametrize(
    "name, schedule",
    [
        ("resnet18", "gpipe"),
        ("resnet18", "zero_bubble"),
        ("resnet18", "interleaved"),
        ("demo_transformer", "1f1b"),
    ],
)
def test_cut_network_trains_like_one_process(name, schedule):
    expected = one_process(name)
    got: dict[str, torch.Tensor] = {}
    for stage in run_on_ranks(_pipelined, 2, name, schedule):
        assert not set(stage) & set(got)  # each parameter on one stage only
        got.update(stage)
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5, msg=key)
