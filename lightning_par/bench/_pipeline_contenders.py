"""The pipeline benchmark's contenders: the workloads, each layout's cut, our schedules on
the one stage runtime and torch's peers on the same stage modules.

Ours: GPipe (the loss on the whole batch's joined output), 1F1B, interleaved 1F1B, zero
bubble (ZB-H1) and ZBV, each on :class:`~lightning_par.pipeline.multistage.DeviceStages`
(:func:`~lightning_par.pipeline.step.forward_backward`). torch's peers:
``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B`` (``v`` stages per rank, as
ours), ``ScheduleInterleavedZeroBubble`` (one stage per rank, as our ZB-H1; torch's class
also takes several) and ``ScheduleZBVZeroBubble`` (two stages per rank in a V, as our ZBV).

Each layout has its own cut per ``M`` (``balances``: ``"pipeline"`` one stage per device,
``"interleaved"`` round-robin, ``"zbv"`` the V), chosen by replaying the schedules with the
measured layer costs (:func:`~lightning_par.pipeline.partition.balance_by_replay`); ours and
torch's rows of one layout share it.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from lightning_par.comm import CommTrace, Communicator
from lightning_par.models import CifarCNN
from lightning_par.pipeline import balance_by_params, forward_backward, split_sequential
from lightning_par.pipeline.multistage import DeviceStages
from lightning_par.pipeline.partition import balance_by_replay, layer_times
from lightning_par.pipeline.schedules import (
    GPIPE,
    INTERLEAVED,
    ONE_F_ONE_B,
    SCHEDULES,
    ZBV,
    ZERO_BUBBLE,
    Schedule,
    get_schedule,
)

Workload = tuple[nn.Sequential, torch.Tensor, torch.Tensor, nn.Module]


def linear_workload() -> Workload:
    """8 x (Linear(1024) + ReLU), batch 256: compute-dominated, easy to balance."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    x, y = torch.randn(256, 1024), torch.randn(256, 1024)
    return nn.Sequential(*layers), x, y, nn.MSELoss()


def cnn_workload(batch: int = 64) -> Workload:
    """The course's CIFAR CNN (width 32, 4 residual blocks), batch 64."""
    torch.manual_seed(0)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    return CifarCNN().net, x, y, nn.CrossEntropyLoss()


WORKLOADS = {"linear": linear_workload, "cnn": cnn_workload}
#: our schedules, in the order of the rows
OURS = (GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE, ZBV)
#: torch's peer of each of ours (a row's name)
PEERS = {s.name: f"torch {s.torch_peer}" for s in OURS}
#: torch's schedules, in the order of the rows
TORCH_SCHEDULES = tuple(s.torch_peer for s in OURS)
#: torch's schedules that take one stage per rank (the others take a list)
TORCH_SINGLE = ("ScheduleGPipe", "Schedule1F1B")


def schedule_of(name: str) -> Schedule:
    """Our schedule a contender is, or is the peer of (``"torch ScheduleGPipe"`` or
    ``"ScheduleGPipe"``: GPipe); the naive split is GPipe with one micro-batch. A row's bubble
    formula is that schedule's."""
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


def balances(workload: str, base: nn.Sequential, x: torch.Tensor, k: int, v: int,
             chunks: list[int], rank: int) -> dict[str, dict[int, list[int]]]:  # fmt: skip
    """The cut of each layout (``"pipeline"``: one stage per device, ``"interleaved"``: ``v``
    dealt round-robin, ``"zbv"``: two in a V) at each micro-batch count ``M`` (1 for the
    naive split): the one whose schedules, replayed with per-layer costs measured at that
    micro-batch size, step fastest (:func:`~lightning_par.pipeline.partition.
    balance_by_replay`); ours and torch's rows of one layout and ``M`` share it. Measured at
    the micro-batch size, not the batch's, because small batches do not cost a fixed share
    (the CNN's best interleaved cut is [2, 1, 1, 2] at M = 4 and [1, 1, 2, 2] at M = 8)."""
    layouts = {
        "pipeline": (k, lambda s: s, [(GPIPE, 1), (ONE_F_ONE_B, 1), (ZERO_BUBBLE, 1)]),
        "interleaved": (k * v, INTERLEAVED.placement(k), [(INTERLEAVED, v)]),
        "zbv": (2 * k, ZBV.placement(k), [(ZBV, 2)]),
    }
    counts = sorted({1, *chunks})
    costs: dict = {}
    if workload == "cnn":
        # forward + backward per layer in CPU time (wall time moves with other processes'
        # load), per micro-batch, measured on rank 0 and shared so every rank cuts alike
        box = [{m: [c * m for c in layer_times(base, x.tensor_split(m)[0], repeat=7,
                                               clock=time.thread_time)]
                for m in counts} if rank == 0 else None]  # fmt: skip
        dist.broadcast_object_list(box, 0)
        costs = box[0]
    cuts: dict[str, dict[int, list[int]]] = {}
    for name, (n, where, kinds) in layouts.items():
        cuts[name] = {}
        for m in counts:
            naive = m == 1 and name == "pipeline"  # M = 1: the naive row (GPipe)
            todo = [(GPIPE, 1)] if naive else kinds
            plans = [s.steps(k, m, vv) for s, vv in todo if runs(s, m, k)]
            if not plans and name != "pipeline":
                continue
            if workload == "linear":  # identical layers: equal parameters are equal work
                cuts[name][m] = balance_by_params(base, n)
            else:
                cuts[name][m] = balance_by_replay(costs[m], plans, n, where)
    return cuts


def _my_stages(base: nn.Sequential, balance: list[int], rank: int, k: int,
               schedule: Schedule) -> dict[int, nn.Module]:  # fmt: skip
    modules = split_sequential(copy.deepcopy(base), balance)
    where = schedule.placement(k)
    return {s: modules[s] for s in range(len(balance)) if where(s) == rank}


def ours(schedule: Schedule, m: int, base: nn.Sequential, cuts: dict[str, dict[int, list[int]]],
         rank: int, k: int, v: int, x: torch.Tensor, y: torch.Tensor, loss_fn: nn.Module,
         checkpoint: str = "never",
         ) -> tuple[DeviceStages, torch.optim.Optimizer, Callable]:  # fmt: skip
    """Our ``schedule`` (one of :data:`OURS`) at ``m`` micro-batches on this rank's stages."""
    assert schedule in OURS
    vv = schedule.stages_per_device(v)
    mine = _my_stages(base, cuts[layout_of(schedule.name)][m], rank, k, schedule)
    device = DeviceStages(mine, k * vv, Communicator(trace=CommTrace(rank)),
                          device_of=schedule.placement(k),
                          split_backward=schedule.split_backward,
                          checkpoint=checkpoint)  # fmt: skip
    params = [p for mod in mine.values() for p in mod.parameters()]
    opt = torch.optim.SGD(params, lr=1e-3)
    return device, opt, lambda: forward_backward(device, x, y, loss_fn, m, schedule, vv)


def theirs(kind: str, m: int, base: nn.Sequential, cuts: dict[str, dict[int, list[int]]],
           rank: int, k: int, v: int, x: torch.Tensor, y: torch.Tensor, loss_fn: nn.Module,
           group: dist.ProcessGroup | None = None,
           ) -> tuple[None, torch.optim.Optimizer, Callable]:  # fmt: skip
    """torch's ``kind`` (one of :data:`TORCH_SCHEDULES`) on the same stage modules, its
    messages over ``group`` (default: every rank's)."""
    from torch.distributed import pipelining  # (its import is slow; only the bench needs it)

    vv = virtual_of(kind, v)
    balance = cuts[layout_of(kind)][m]
    mine = _my_stages(base, balance, rank, k, schedule_of(kind))
    micro = x.tensor_split(m)[0]
    stages = []
    for s, module in mine.items():
        with torch.no_grad():
            inp = base[: sum(balance[:s])](micro) if s else micro
        stages.append(pipelining.PipelineStage(module, s, k * vv, torch.device("cpu"),
                                               input_args=(inp,), group=group))  # fmt: skip
    schedule = getattr(pipelining, kind)(
        stages[0] if kind in TORCH_SINGLE else stages, n_microbatches=m, loss_fn=loss_fn
    )
    params = [p for mod in mine.values() for p in mod.parameters()]
    opt = torch.optim.SGD(params, lr=1e-3)
    holds_first, holds_last = 0 in mine, k * vv - 1 in mine
    args = (x,) if holds_first else ()
    kwargs = {"target": y} if holds_last else {}
    return None, opt, lambda: schedule.step(*args, **kwargs)
