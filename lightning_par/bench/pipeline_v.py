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
from lightning_par.pipeline.schedules import (
    GPIPE,
    INTERLEAVED,
    SCHEDULES,
    ZBV,
    ZERO_BUBBLE,
    Schedule,
    get_schedule,
)
from lightning_par.pipeline.step import scheduled_step

#: our schedules on DeviceStages
OURS_V = (INTERLEAVED, ZERO_BUBBLE, ZBV)
#: torch's peers of them (and how many stages per rank each uses: as ours)
TORCH_V_SCHEDULES = tuple(s.torch_peer for s in OURS_V)
PEERS_V = {s.name: f"torch {s.torch_peer}" for s in OURS_V}


def schedule_of(name: str) -> Schedule:
    """Our schedule a contender is, or is the peer of (``"torch ScheduleGPipe"`` or
    ``"ScheduleGPipe"``: GPipe); the naive split is GPipe with one micro-batch."""
    peers = {s.torch_peer: s for s in SCHEDULES.values()}
    found = peers.get(name.removeprefix("torch "))
    return found or (GPIPE if name == "naive" else get_schedule(name))


def layout_of(name: str) -> str:
    """Which cut a contender runs on: ``"interleaved"``, ``"zbv"`` or ``"pipeline"``."""
    schedule = schedule_of(name)
    if schedule.v_shape:
        return "zbv"
    return "interleaved" if schedule.takes_virtual_stages else "pipeline"


def virtual_of(name: str, virtual_stages: int) -> int:
    """Stages per device of a contender: ``v`` for the interleaved ones, 2 for ZBV, else 1."""
    return schedule_of(name).stages_per_device(virtual_stages)


def runs(schedule: Schedule, chunks: int, num_devices: int) -> bool:
    """Whether our ``schedule`` runs at this ``chunks`` (interleaved: M a multiple of K)."""
    try:
        schedule.check_chunks(chunks, num_devices)
    except ValueError:
        return False
    return True


def _my_stages(base: nn.Sequential, balance: list[int], rank: int, k: int,
               schedule: Schedule) -> dict[int, nn.Module]:  # fmt: skip
    modules = split_sequential(copy.deepcopy(base), balance)
    where = schedule.placement(k)
    return {s: modules[s] for s in range(len(balance)) if where(s) == rank}


def ours_v(schedule: Schedule, m: int, base: nn.Sequential,
           balances: dict[str, dict[int, list[int]]], rank: int, k: int, v: int,
           x: torch.Tensor, y: torch.Tensor,
           loss_fn: nn.Module) -> tuple[DeviceStages, torch.optim.Optimizer, Callable]:  # fmt: skip
    """Our ``schedule`` (one of :data:`OURS_V`) at ``m`` micro-batches."""
    vv = schedule.stages_per_device(v)
    mine = _my_stages(base, balances[layout_of(schedule.name)][m], rank, k, schedule)
    device = DeviceStages(mine, k * vv, Communicator(trace=CommTrace(rank)),
                          device_of=schedule.placement(k),
                          split_backward=schedule.split_backward)  # fmt: skip
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
    mine = _my_stages(base, balance, rank, k, schedule_of(kind))
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
