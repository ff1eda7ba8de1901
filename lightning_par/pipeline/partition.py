"""Splitting an ``nn.Sequential`` into pipeline stages.

GPipe (Huang et al., 2019, section 2.2) cuts a sequence of layers into K consecutive cells,
one per device; the pipeline runs only as fast as its slowest stage, so the cut should
balance the cost per stage. A ``balance`` is the number of layers per stage, e.g.
``[3, 5]`` for two stages over eight layers (torchgpipe's convention).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from lightning_par.pipeline.schedule import Step
from lightning_par.pipeline.validate import simulate
from lightning_par.split import balance_by_cost, bounds


def check_balance(num_layers: int, balance: Sequence[int], world_size: int | None = None) -> None:
    """Raise ``ValueError`` with a fix when ``balance`` cannot split ``num_layers`` layers."""
    balance = list(balance)
    if not balance:
        raise ValueError("balance is empty: give the number of layers for each stage, e.g. [2, 2]")
    if any(not isinstance(n, int) or n < 1 for n in balance):
        raise ValueError(f"balance {balance} must hold positive integers (layers per stage)")
    if len(balance) > num_layers:
        raise ValueError(
            f"{len(balance)} stages but the network has only {num_layers} layers: "
            "use at most one stage per layer"
        )
    if sum(balance) != num_layers:
        raise ValueError(
            f"balance {balance} sums to {sum(balance)} but the network has {num_layers} layers; "
            "the numbers of layers per stage must add up to the number of layers"
        )
    if world_size is not None and len(balance) != world_size:
        raise ValueError(
            f"balance {balance} has {len(balance)} stages but there are {world_size} processes "
            "(one stage per process): make len(balance) equal the number of devices"
        )


def split_sequential(net: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """The stages of ``net`` (sharing its layers), keeping each layer's original index as its
    name so that stage state dicts merge back into the full network's."""
    if not isinstance(net, nn.Sequential):
        raise TypeError(
            f"pipelining needs an nn.Sequential to split into stages, got {type(net).__name__}"
        )
    check_balance(len(net), balance)
    stages, start = [], 0
    names = [name for name, _ in net.named_children()]
    for size in balance:
        stage = nn.Sequential()
        for name in names[start : start + size]:
            stage.add_module(name, getattr(net, name))
        stages.append(stage)
        start += size
    return stages


def stage_bounds(balance: Sequence[int]) -> list[tuple[int, int]]:
    """``[(first, stop), ...]`` layer index ranges of each stage."""
    return bounds(balance)


def balance_for_devices(
    costs: Sequence[float], num_stages: int, device_of: Callable[[int], int]
) -> list[int]:
    """Cut ``costs`` (one per layer) into ``num_stages`` consecutive stages so that the
    busiest *device* is as cheap as possible, when stage ``s`` runs on ``device_of(s)``
    (several stages per device: interleaved, ZBV); ties go to the cut whose largest stage is
    cheapest. With one stage per device this is :func:`balance_by_cost`'s objective. A
    device runs all its stages' steps, so its total bounds the step, not its largest stage:
    on the CIFAR CNN cut into 4 stages, the cut with the cheapest largest stage puts 58 %
    of the work on one device under round-robin dealing, the cut this returns 52 %.
    Exhaustive over the cuts, falling back to :func:`balance_by_cost` past 200,000 cuts."""
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(
            f"cannot split {n} layers into {num_stages} stages: need 1 <= stages <= layers"
        )
    if math.comb(n - 1, num_stages - 1) > 200_000:
        return balance_by_cost(costs, num_stages)
    prefix = list(itertools.accumulate((float(c) for c in costs), initial=0.0))
    best, best_key = None, None
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        edges = (0, *cuts, n)
        stage_cost = [prefix[b] - prefix[a] for a, b in itertools.pairwise(edges)]
        per_device: dict[int, float] = {}
        for s, c in enumerate(stage_cost):
            per_device[device_of(s)] = per_device.get(device_of(s), 0.0) + c
        key = (max(per_device.values()), max(stage_cost))
        if best_key is None or key < best_key:
            best, best_key = [b - a for a, b in itertools.pairwise(edges)], key
    assert best is not None
    return best


def balance_by_replay(costs: Sequence[float], schedules: Sequence[Sequence[Sequence[Step]]],
                      num_stages: int, device_of: Callable[[int], int]) -> list[int]:  # fmt: skip
    """The cut whose step is shortest when the ``schedules`` (step lists per device, e.g.
    one schedule at several micro-batch counts) are replayed with these per-layer costs
    (:func:`~lightning_par.pipeline.validate.simulate`: free messages; a stage's forward
    costs a third of its layers' forward + backward ``costs`` divided by ``M``, a backward
    two thirds, B and W one third each). Minimises the sum of the replayed step times; ties
    go to :func:`balance_for_devices`' order.

    Why not the busiest device alone: a device's stages must also be *ready* when it is
    free. On the CIFAR CNN, cut into 4 stages for interleaved 1F1B at M = 8, the cut with
    the cheapest busiest device, [1, 2, 2, 1], replays to a 208 ms step; [1, 1, 2, 2],
    1 % dearer on the busiest device, to 179 ms (its early stages are short, so the
    second device starts sooner). Exhaustive over the cuts; past 2,000 cuts it returns
    :func:`balance_for_devices`."""
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(
            f"cannot split {n} layers into {num_stages} stages: need 1 <= stages <= layers"
        )
    if math.comb(n - 1, num_stages - 1) > 2_000 or not schedules:
        return balance_for_devices(costs, num_stages, device_of)
    prefix = list(itertools.accumulate((float(c) for c in costs), initial=0.0))
    share = {"fwd": 1 / 3, "bwd": 2 / 3, "bwd_input": 1 / 3, "bwd_weight": 1 / 3}
    best, best_key = None, None
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        edges = (0, *cuts, n)
        stage_cost = [prefix[b] - prefix[a] for a, b in itertools.pairwise(edges)]
        total = 0.0
        for steps in schedules:
            m = 1 + max(s.micro_batch for lst in steps for s in lst)
            durations = [[stage_cost[s.stage] * share[s.op] / m for s in lst] for lst in steps]
            total += max(t.end for t in simulate(steps, num_stages, durations=durations))
        per_device: dict[int, float] = {}
        for s, c in enumerate(stage_cost):
            per_device[device_of(s)] = per_device.get(device_of(s), 0.0) + c
        key = (round(total, 9), max(per_device.values()), max(stage_cost))
        if best_key is None or key < best_key:
            best, best_key = [b - a for a, b in itertools.pairwise(edges)], key
    assert best is not None
    return best


def balance_by_params(net: nn.Sequential, num_stages: int) -> list[int]:
    """Balance by parameter count. A layer without parameters joins the next layer (the last
    one joins the previous), so that no stage is left without parameters to train when the
    network has enough parameterised layers (torch optimisers reject an empty parameter list)."""
    counts = [sum(p.numel() for p in layer.parameters()) for layer in net]
    units: list[list[int]] = []  # groups of layer indices, each with parameters if possible
    pending: list[int] = []
    for i, count in enumerate(counts):
        pending.append(i)
        if count:
            units.append(pending)
            pending = []
    if pending:
        if units:
            units[-1] += pending
        else:
            units.append(pending)
    if len(units) < num_stages:  # too few parameterised layers: cut between any layers
        return balance_by_cost([max(1, c) for c in counts], num_stages)
    unit_balance = balance_by_cost([sum(counts[i] for i in unit) for unit in units], num_stages)
    balance, start = [], 0
    for size in unit_balance:
        balance.append(sum(len(unit) for unit in units[start : start + size]))
        start += size
    return balance


def layer_times(net: nn.Sequential, sample: torch.Tensor, repeat: int = 3,
                clock: Callable[[], float] = time.perf_counter) -> list[float]:  # fmt: skip
    """Seconds for forward + backward of each layer on ``sample`` (best of ``repeat``), by
    ``clock``: wall time by default; ``time.thread_time`` (this thread's CPU time) for CPU
    layers on a shared machine, where other processes' load moves wall time (the pipeline
    bench's cut flipped from [3, 3] to [2, 4] on the CIFAR CNN at load 4-6) but hardly CPU
    time."""
    times, x = [], sample
    for layer in net:
        best = float("inf")
        for _ in range(repeat):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = clock()
            out = layer(inp)
            wrt = [t for t in (inp, *layer.parameters()) if t.requires_grad]
            if out.requires_grad and wrt:  # autograd.grad leaves .grad untouched
                torch.autograd.grad(out, wrt, torch.ones_like(out), allow_unused=True)
            if out.device.type == "cuda":
                torch.cuda.synchronize(out.device)
            best = min(best, clock() - start)
        times.append(best)
        with torch.no_grad():
            x = layer(x)
    return times


def balance_by_time(
    net: nn.Sequential, sample: torch.Tensor, num_stages: int, repeat: int = 3
) -> list[int]:
    """Balance by measured forward + backward time per layer (torchgpipe's ``balance_by_time``)."""
    return balance_by_cost(layer_times(net, sample, repeat), num_stages)
