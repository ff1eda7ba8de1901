"""The benchmark's contenders with several stages per device or a split backward.

Ours: interleaved 1F1B and zero bubble on :class:`~lightning_par.pipeline.multistage.
DeviceStages` (:func:`~lightning_par.pipeline.step.scheduled_step`). torch's peers on the
same stage modules: ``ScheduleInterleaved1F1B`` (``v`` stages per rank, as ours),
``ScheduleInterleavedZeroBubble`` (one stage per rank, as our ZB-H1; torch's class also
takes several) and ``ScheduleZBVZeroBubble`` (two stages per rank in a V, as our ZBV). Used
by :mod:`lightning_par.bench.pipeline`.

Each layout has its own cut per ``M`` (``balances``: ``"pipeline"`` one stage per device,
``"interleaved"`` round-robin, ``"zbv"`` the V), chosen by replaying the schedules with
the measured layer costs (:func:`~lightning_par.pipeline.partition.balance_by_replay`);
ours and torch's rows of one layout share it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from lightning_par.comm import CommTrace, Communicator
from lightning_par.pipeline import split_sequential
from lightning_par.pipeline.multistage import DeviceStages
from lightning_par.pipeline.schedules_v import SPLIT_SCHEDULES, placement
from lightning_par.pipeline.step import scheduled_step

#: torch's peers of our new schedules (and how many stages per rank each uses)
TORCH_V_SCHEDULES = ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
                     "ScheduleZBVZeroBubble")  # fmt: skip
#: our schedules on DeviceStages
OURS_V = ("interleaved", "zero_bubble", "zbv")
PEERS_V = {"interleaved": "torch ScheduleInterleaved1F1B",
           "zero_bubble": "torch ScheduleInterleavedZeroBubble",
           "zbv": "torch ScheduleZBVZeroBubble"}  # fmt: skip


def layout_of(name: str) -> str:
    """Which cut a contender runs on: ``"interleaved"``, ``"zbv"`` or ``"pipeline"``."""
    if "nterleaved1F1B" in name or name == "interleaved":
        return "interleaved"
    return "zbv" if name == "zbv" or "ZBVZeroBubble" in name else "pipeline"


def virtual_of(name: str, virtual_stages: int) -> int:
    """Stages per device of a contender: ``v`` for the interleaved ones, 2 for ZBV, else 1."""
    return {"interleaved": virtual_stages, "zbv": 2}.get(layout_of(name), 1)


def runs(name: str, chunks: int, num_devices: int, virtual_stages: int) -> bool:
    """Whether the contender runs at this ``chunks`` (ours: interleaved needs M % K == 0)."""
    if name == "interleaved":
        return chunks % num_devices == 0
    return True


def _my_stages(base: nn.Sequential, balance: list[int], rank: int, k: int,
               schedule: str) -> dict[int, nn.Module]:  # fmt: skip
    modules = split_sequential(copy.deepcopy(base), balance)
    where = placement(schedule, k)
    return {s: modules[s] for s in range(len(balance)) if where(s) == rank}


def ours_v(schedule: str, m: int, base: nn.Sequential, balances: dict[str, dict[int, list[int]]],
           rank: int, k: int, v: int, x: torch.Tensor, y: torch.Tensor,
           loss_fn: nn.Module) -> tuple[DeviceStages, torch.optim.Optimizer, Callable]:  # fmt: skip
    """Our ``schedule`` (one of :data:`OURS_V`) at ``m`` micro-batches."""
    assert schedule in OURS_V
    vv = virtual_of(schedule, v)
    mine = _my_stages(base, balances[layout_of(schedule)][m], rank, k, schedule)
    device = DeviceStages(mine, k * vv, Communicator(trace=CommTrace(rank)),
                          device_of=placement(schedule, k),
                          split_backward=schedule in SPLIT_SCHEDULES)  # fmt: skip
    params = [p for mod in mine.values() for p in mod.parameters()]
    opt = torch.optim.SGD(params, lr=1e-3)
    return device, opt, lambda: scheduled_step(device, x, y, loss_fn, m, schedule, vv)


def theirs_v(kind: str, m: int, base: nn.Sequential, balances: dict[str, dict[int, list[int]]],
             rank: int, k: int, v: int, x: torch.Tensor, y: torch.Tensor,
             loss_fn: nn.Module) -> tuple[None, torch.optim.Optimizer, Callable]:  # fmt: skip
    """torch's ``kind`` on the same stage modules."""
    from torch.distributed import pipelining

    vv = virtual_of(kind, v)
    balance = balances[layout_of(kind)][m]
    mine = _my_stages(base, balance, rank, k, "zbv" if layout_of(kind) == "zbv" else "")
    micro = x.tensor_split(m)[0]
    stages = []
    for s, module in mine.items():
        with torch.no_grad():
            inp = base[: sum(balance[:s])](micro) if s else micro
        stages.append(pipelining.PipelineStage(module, s, k * vv, torch.device("cpu"),
                                               input_args=(inp,)))  # fmt: skip
    schedule = getattr(pipelining, kind)(stages, n_microbatches=m, loss_fn=loss_fn)
    params = [p for mod in mine.values() for p in mod.parameters()]
    opt = torch.optim.SGD(params, lr=1e-3)
    holds_first, holds_last = 0 in mine, k * vv - 1 in mine
    args = (x,) if holds_first else ()
    kwargs = {"target": y} if holds_last else {}
    return None, opt, lambda: schedule.step(*args, **kwargs)
