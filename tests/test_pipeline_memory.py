"""Measured activation memory (live and peak saved bytes) and the timeline plot's axis."""

from __future__ import annotations

import time

import matplotlib
import torch
from torch import nn

from lightning_par.comm import CommTrace, Communicator, run_on_ranks
from lightning_par.pipeline import DeviceStages, forward_backward, split_sequential

matplotlib.use("Agg")

WIDTH, BATCH, CHUNKS = 64, 32, 8
MB_BYTES = BATCH // CHUNKS * WIDTH * 4  # one (micro-batch x WIDTH) float tensor


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])


def _memory(rank: int, world_size: int) -> dict:
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    out = {}
    for schedule, mode in [("gpipe", "never"), ("1f1b", "never"), ("gpipe", "always")]:
        stage = DeviceStages(
            {rank: split_sequential(_net(), [4, 4])[rank]},
            world_size,
            Communicator(),
            checkpoint=mode,
        )
        stage.measure_memory()
        for _ in range(2):  # the counter restarts every step
            forward_backward(stage, x, y, nn.MSELoss(), CHUNKS, schedule)
        saved = stage.saved
        out[schedule, mode] = (saved.nbytes, saved.peak, saved.live, saved.history[-1][1])
    return out


def test_peak_saved_bytes_follow_the_schedule():
    stage0, stage1 = run_on_ranks(_memory, 2)
    # each stage: Linear, Tanh, Linear, Tanh; the Tanh outputs are saved (the Linears save
    # their inputs: the same storages), stage 1 also its received input, stage 0 the batch
    batch = BATCH * WIDTH * 4
    per_mb = {0: 2 * MB_BYTES, 1: 3 * MB_BYTES}
    for rank, result, first in [(0, stage0, batch), (1, stage1, 0)]:
        nbytes, peak, live, last = result["gpipe", "never"]
        assert peak == nbytes == first + CHUNKS * per_mb[rank]  # GPipe holds every micro-batch
        assert live == last == 0  # all released by the end of the step
        held = 2 - rank  # 1F1B on K = 2: stage s holds at most K - s micro-batches
        assert result["1f1b", "never"][1] == first + held * per_mb[rank]
        nbytes, peak, live, _ = result["gpipe", "always"]  # only the stage inputs are kept
        assert peak == nbytes == (batch if rank == 0 else CHUNKS * MB_BYTES) and live == 0


def _traced(rank: int, world_size: int) -> CommTrace:
    comm = Communicator(trace=CommTrace(rank))
    module = split_sequential(_net(), [4, 4])[rank]
    stage = DeviceStages({rank: module}, world_size, comm, checkpoint="except_last")
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    for step in range(2):
        if step == 1 and rank == 0:
            time.sleep(0.2)  # so stage 1 surely posts step 1's receives before this forward
        forward_backward(stage, x, y, nn.MSELoss(), 4, "gpipe")
    return comm.trace


def test_timeline_starts_at_the_first_forward():
    import matplotlib.pyplot as plt

    from lightning_par.pipeline.timeline import plot_timeline, step_window

    traces = run_on_ranks(_traced, 2)
    start, _ = step_window(traces, 1)
    # stage 1 posts step 1's receives while stage 0 still runs step 0's backward
    recvs = [
        t.origin + m.start for t in traces for m in t.messages if m.step == 1 and m.op == "recv"
    ]
    assert min(recvs) < start
    ax = plot_timeline(traces, step=1)
    assert ax.get_xlim()[0] == 0.0
    assert all(patch.get_x() >= 0.0 for patch in ax.patches)
    assert len(ax.get_legend().get_texts()) == 4
    plt.close(ax.figure)


def test_each_device_holds_its_share_of_a_resnet():
    """bench pipeline_memory: K devices hold the whole network's parameters and Adam state
    between them, once each, and none holds more than two thirds of it at K = 2."""
    from lightning_par.bench.pipeline_memory import measure

    whole, *stages = measure("resnet18", [2])
    assert sum(r["param_bytes"] for r in stages) == whole["param_bytes"]
    assert sum(r["optimizer_bytes"] for r in stages) == whole["optimizer_bytes"]
    assert all(0 < r["param_bytes"] < 2 / 3 * whole["param_bytes"] for r in stages)
