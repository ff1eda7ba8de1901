"""The benchmark's contenders with several stages per device or a split backward.

Ours: interleaved 1F1B and zero bubble on :class:`~lightning_par.pipeline.multistage.
DeviceStages` (:func:`~lightning_par.pipeline.step.scheduled_step`). torch's peers on the
same stage modules: ``ScheduleInterleaved1F1B`` (``v`` stages per rank, as ours) and
``ScheduleInterleavedZeroBubble`` (one stage per rank, as our ZB-H1; torch's class also
takes several). Used by :mod:`lightning_par.bench.pipeline`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from lightning_par.comm import CommTrace, Communicator
from lightning_par.pipeline import split_sequential
from lightning_par.pipeline.multistage import DeviceStages
from lightning_par.pipeline.schedules_v import NEW_SCHEDULES
from lightning_par.pipeline.step import scheduled_step

#: torch's peers of our new schedules (and how many stages per rank each uses)
TORCH_V_SCHEDULES = ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble")
PEERS_V = {"interleaved": "torch ScheduleInterleaved1F1B",
           "zero_bubble": "torch ScheduleInterleavedZeroBubble"}  # fmt: skip


def virtual_of(name: str, virtual_stages: int) -> int:
    """Stages per device of a contender: ``v`` for the interleaved ones, else 1."""
    return virtual_stages if "nterleaved1F1B" in name or name == "interleaved" else 1


def runs(name: str, chunks: int, num_devices: int, virtual_stages: int) -> bool:
    """Whether the contender runs at this ``chunks`` (ours: interleaved needs M % K == 0)."""
    if name == "interleaved":
        return chunks % num_devices == 0
    return True


def _my_stages(base: nn.Sequential, balance: list[int], rank: int, k: int) -> dict[int, nn.Module]:
    modules = split_sequential(copy.deepcopy(base), balance)
    return {s: modules[s] for s in range(rank, len(balance), k)}


def ours_v(schedule: str, m: int, base: nn.Sequential, balances: dict[int, list[int]],
           rank: int, k: int, v: int, x: torch.Tensor, y: torch.Tensor,
           loss_fn: nn.Module) -> tuple[DeviceStages, torch.optim.Optimizer, Callable]:  # fmt: skip
    """Our ``schedule`` (one of :data:`NEW_SCHEDULES`) at ``m`` micro-batches."""
    assert schedule in NEW_SCHEDULES
    vv = virtual_of(schedule, v)
    mine = _my_stages(base, balances[vv], rank, k)
    device = DeviceStages(mine, k * vv, Communicator(trace=CommTrace(rank)),
                          split_backward=schedule == "zero_bubble")  # fmt: skip
    params = [p for mod in mine.values() for p in mod.parameters()]
    opt = torch.optim.SGD(params, lr=1e-3)
    return device, opt, lambda: scheduled_step(device, x, y, loss_fn, m, schedule, vv)


def theirs_v(kind: str, m: int, base: nn.Sequential, balances: dict[int, list[int]],
             rank: int, k: int, v: int, x: torch.Tensor, y: torch.Tensor,
             loss_fn: nn.Module) -> tuple[None, torch.optim.Optimizer, Callable]:  # fmt: skip
    """torch's ``kind`` on the same stage modules."""
    from torch.distributed import pipelining

    vv = virtual_of(kind, v)
    balance = balances[vv]
    mine = _my_stages(base, balance, rank, k)
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
