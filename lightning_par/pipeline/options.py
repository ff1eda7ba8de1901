"""The pipeline strategies' ``nn.Sequential`` network, built for the schedule with no Lightning
in sight: :class:`~lightning_par.strategies.gpipe.GPipeStrategy` (and the hybrid grid's
pipelines) call this.

* ``"gpipe"`` or ``"1f1b"``: one stage per device,
  :class:`~lightning_par.pipeline.sequential.PipelinedSequential`;
* ``"interleaved"`` (``virtual_stages`` stages per device) or ``"zero_bubble"`` (ZB-H1, the
  backward split): :class:`~lightning_par.pipeline.sequential_v.PipelinedStages`.

The schedule's own rules (chunks, re-materialisation) are its object's
(:mod:`lightning_par.pipeline.schedules`).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_par.comm import Communicator
from lightning_par.pipeline.partition import split_sequential
from lightning_par.pipeline.schedules import Schedule
from lightning_par.pipeline.sequential import PipelinedSequential
from lightning_par.pipeline.sequential_v import PipelinedStages, device_states


def build_network(net: nn.Sequential, balance: Sequence[int], comm: Communicator, *,
                  chunks: int, checkpoint: str, schedule: Schedule,
                  virtual_stages: int = 1) -> tuple[nn.Module, list[dict] | None]:  # fmt: skip
    """This rank's pipelined network and, on rank 0, every device's state dict from ``net``
    (to send the same initial weights everywhere); ``balance`` has one entry per stage."""
    if schedule.takes_virtual_stages or schedule.split_backward:
        piped = PipelinedStages(net, balance, comm, chunks=chunks, checkpoint=checkpoint,
                                schedule=schedule.name, virtual_stages=virtual_stages)  # fmt: skip
        first = device_states(net, balance, comm.world_size) if comm.rank == 0 else None
        return piped, first
    piped = PipelinedSequential(net, balance, comm, chunks=chunks, checkpoint=checkpoint,
                                schedule=schedule.name)  # fmt: skip
    if comm.rank != 0:
        return piped, None
    return piped, [s.state_dict() for s in split_sequential(net, list(balance))]
