"""torchgpipe's tests, written anew for this project's pipeline (after ``kakaobrain/
torchgpipe``: ``tests/test_transparency.py``, the gradients of a model with and without the
pipeline are equal; ``tests/test_deferred_batch_norm.py``, BatchNorm's running statistics
over micro-batches equal the whole batch's, and so do its evaluation outputs; and
``torchgpipe/pipeline.py``'s ``clock_cycles``: in GPipe's lock-step timeline, micro-batch
``i`` runs on stage ``j`` at clock ``i + j``).

The pipeline runs over processes here (two ranks, gloo), not torchgpipe's CUDA streams.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_par.comm import Communicator, run_on_ranks
from lightning_par.graphcut import split_module
from lightning_par.pipeline.batchnorm import DeferredBatchNorm
from lightning_par.pipeline.network import PipelinedNetwork
from lightning_par.pipeline.schedules import clock_table

CHUNKS = 4


def _linears() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, 2), nn.Linear(2, 4), nn.Linear(4, 2), nn.Linear(2, 1))


def _inputs() -> torch.Tensor:
    return torch.rand(8, 1, generator=torch.Generator().manual_seed(1))


def _pipelined_grads(rank: int, world: int, schedule: str) -> dict[str, torch.Tensor]:
    model = _linears()
    split = split_module(model, (_inputs()[:2],), ["2"])  # balance [2, 2]
    network = PipelinedNetwork(model, split, Communicator(), chunks=CHUNKS, schedule=schedule)
    network.active = True
    if schedule != "gpipe":
        network.expect(torch.zeros(8, 1), lambda out, _: out.mean())
    model(_inputs()).mean().backward()
    network.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
def test_gradients_equal_with_and_without_the_pipeline(schedule):
    model = _linears()
    model(_inputs()).mean().backward()
    expected = {n: p.grad for n, p in model.named_parameters()}
    got: dict[str, torch.Tensor] = {}
    for stage in run_on_ranks(_pipelined_grads, 2, schedule, timeout=60):
        assert not set(stage) & set(got)  # each layer's gradient on its own stage only
        got.update(stage)
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def _tilted(seed: int = 0) -> torch.Tensor:
    """Channels of very different scales, samples of very different means (as torchgpipe's
    ``tilt_dist``): micro-batch statistics then differ visibly from the batch's."""
    x = torch.rand(16, 3, 8, 8, generator=torch.Generator().manual_seed(seed))
    x = x * torch.tensor([1.0, 10.0, 100.0]).view(1, 3, 1, 1)
    return x + (2.0 ** torch.arange(16.0)).view(16, 1, 1, 1) / 2**8


@pytest.mark.parametrize("momentum", [0.1, None])
def test_deferred_batch_norm_tracks_the_whole_batchs_statistics(momentum):
    whole = nn.BatchNorm2d(3, momentum=momentum)
    deferred = DeferredBatchNorm.from_batch_norm(nn.BatchNorm2d(3, momentum=momentum))
    plain = nn.BatchNorm2d(3, momentum=momentum)  # micro-batches without deferring
    for step in range(3):
        x = _tilted(step)
        whole(x)
        for chunk in x.chunk(CHUNKS):
            deferred(chunk)
            plain(chunk)
        deferred.commit()
    torch.testing.assert_close(deferred.running_mean, whole.running_mean)
    torch.testing.assert_close(deferred.running_var, whole.running_var)
    assert not torch.allclose(plain.running_var, whole.running_var)  # the test can tell
    whole.eval()
    deferred.eval()
    x = _tilted(9)
    torch.testing.assert_close(deferred(x), whole(x))


@pytest.mark.parametrize("stages, chunks", [(2, 4), (3, 5), (4, 8)])
def test_gpipe_forwards_run_in_lock_step(stages, chunks):
    table = clock_table("gpipe", stages, chunks)  # table[clock][stage]: the step or None
    forwards = {
        (step.micro_batch, stage): clock
        for clock, row in enumerate(table)
        for stage, step in enumerate(row)
        if step is not None and step.op == "fwd"
    }
    assert forwards == {(i, j): i + j for i in range(chunks) for j in range(stages)}
