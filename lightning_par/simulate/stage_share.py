"""Each pipeline stage's share of the model's compute at ``p`` stages, and the bytes at each
cut, under the cut the strategy makes there.

A pipeline does not split its model evenly: :class:`~lightning_par.strategies.gpipe.
GPipeStrategy` cuts ``module.net`` by parameter count by default
(:func:`~lightning_par.pipeline.partition.balance_by_params`), and the compare's CifarCNN
(stem, two residual blocks, head) goes ``[2, 2]`` at 2 stages, ``[2, 1, 1]`` at 3 and
``[1, 1, 1, 1]`` at 4. Its busiest stage holds 57 % of the model at 2 and at 3 stages, 45 %
at 4 (fwd + bwd CPU time per layer on a micro-batch of 12 here: 1.5, 5.6, 5.0, 0.2 ms; the
traced stages of a 4-stage run read 12 %, 46 %, 38 %, 4 %), where an even split would give
the busiest stage a third and a quarter. So a stage's forward and backward at ``p`` are the
whole model's (the measured stages summed) times its share of the layers it holds.

Where the profile holds each measured stage's time (``Profile.stage_s``), a layer's weight is
its stage's measured time split over the stage's layers by their timings: the layers timed
alone moved a stage's share by a quarter between two timings on a busy machine (stage 2 of
4: 31 % once, 45 % the next time, the gpipe 2 -> 4 prediction from 69 to 82 ms), while the
measured stages hold most of it and the cost of a stage in the training loop. The timing
warms the network up first: its first pass allocates.

Layers are weighed by their forward + backward time on this machine (thread CPU time, best
of several, one thread: :func:`~lightning_par.pipeline.partition.layer_times`) when the
simulator predicts this machine, else by their forward FLOPs (torch's ``FlopCounterMode``;
backward is about twice the forward in each weight layer, so the share holds for a step).
"""

from __future__ import annotations

import functools
import itertools
import time

import torch
from torch import nn

from lightning_par.measure.run import make_model, sample_shape
from lightning_par.pipeline.partition import balance_by_params, layer_times
from lightning_par.simulate.profile import Profile
from lightning_par.simulate.timings import cached_from_here, timed
from lightning_par.split import balance_by_cost

REPEATS = 5


def _net(model_name: str) -> tuple[nn.Sequential, torch.Tensor]:
    model = make_model(model_name)
    net = getattr(model, "net", None)
    if not isinstance(net, nn.Sequential):
        raise ValueError(f"{model_name} has no nn.Sequential module.net to cut into stages")
    return net, torch.zeros(1, *sample_shape(model))


@functools.cache
def layer_weights(model_name: str, micro_batch: int = 0) -> tuple[float, ...]:
    """Each layer of ``module.net``'s weight: its fwd + bwd seconds on a micro-batch of
    ``micro_batch`` here (one thread), or its forward FLOPs where ``micro_batch`` is 0."""
    net, one = _net(model_name)
    if micro_batch:

        def measure() -> list[float]:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                x = torch.randn(micro_batch, *one.shape[1:], generator=torch.Generator())
                net(x.requires_grad_()).sum().backward()  # warm: the first pass allocates
                return list(layer_times(net, x.detach(), REPEATS, clock=time.thread_time))
            finally:
                torch.set_num_threads(threads)

        return tuple(timed(f"layer_weights/{model_name}/{micro_batch}", measure))
    from torch.utils.flop_counter import FlopCounterMode  # only needed here

    weights, x = [], one
    with torch.no_grad():
        for layer in net:
            counter = FlopCounterMode(display=False)
            with counter:
                x = layer(x)
            weights.append(float(counter.get_total_flops()))
    return tuple(weights)


cached_from_here(layer_weights.cache_clear)


def stage_balance(model_name: str, p: int, options: dict, micro_batch: int = 0) -> list[int]:
    """Layers per stage the strategy cuts ``module.net`` into at ``p`` stages: its
    ``balance`` option where it names ``p`` stages, by measured time where
    ``balance_by="time"``, else by parameters (the default)."""
    given = options.get("balance")
    if given and len(given) == p:
        return list(given)
    net, _ = _net(model_name)
    if options.get("balance_by") == "time":
        return balance_by_cost(list(layer_weights(model_name, micro_batch)), p)
    return balance_by_params(net, p)


Measured = tuple[list[int], tuple[float, ...]]


def stage_shares(model_name: str, balance: list[int], micro_batch: int = 0,
                 measured: Measured | None = None) -> list[float]:  # fmt: skip
    """Each stage of ``balance``'s share of the whole model's compute (they sum to 1),
    weighed by :func:`layer_weights`. ``measured``: a run's own cut and each of its stages'
    measured time, which each layer of a stage takes its :func:`layer_weights` part of
    (timing a layer alone moves by a quarter between two timings on a busy machine; the
    measured stages hold their layers' ratio, and a stage's cost in the training loop)."""
    weights = list(layer_weights(model_name, micro_batch))
    if measured is not None:
        weights = _anchored(weights, *measured)
    edges = [0, *itertools.accumulate(balance)]
    total = sum(weights) or 1.0
    return [sum(weights[a:b]) / total for a, b in itertools.pairwise(edges)]


def _anchored(weights: list[float], balance: list[int], stage_s: tuple[float, ...]
              ) -> list[float]:  # fmt: skip
    """``weights`` with each stage of ``balance`` scaled to its measured ``stage_s``."""
    if len(balance) != len(stage_s) or sum(balance) != len(weights):
        return weights
    out, edges = list(weights), [0, *itertools.accumulate(balance)]
    for (a, b), took in zip(itertools.pairwise(edges), stage_s):
        held = sum(weights[a:b])
        for i in range(a, b):
            out[i] = took * (weights[i] / held if held else 1 / (b - a))
    return out


@functools.cache
def _cut_bytes(model_name: str, balance: tuple[int, ...], micro_batch: int) -> tuple[int, ...]:
    net, one = _net(model_name)
    x = torch.zeros(max(micro_batch, 1), *one.shape[1:])
    out, layer = [], 0
    with torch.no_grad():
        for size in balance[:-1]:
            for module in list(net)[layer : layer + size]:
                x = module(x)
            layer += size
            out.append(x.numel() * x.element_size())
    return tuple(out)


def cut_bytes(model_name: str, balance: list[int], micro_batch: int) -> list[int]:
    """The activation bytes stage ``s`` sends stage ``s + 1`` per micro-batch of
    ``micro_batch`` samples (its gradient comes back the same size), for each cut of
    ``balance``."""
    return list(_cut_bytes(model_name, tuple(balance), micro_batch))


def stages_at(prof: Profile, p: int, chunks: int, here: bool) -> tuple[list[float], list[int]]:
    """Each stage's share of the model and the activation bytes at each cut at ``p``
    stages: the strategy's own cut of the compare model (layers timed here when the
    simulator predicts this machine: ``here``), or an even split and the measured
    activation size for a user's own run (or a model without ``module.net``)."""
    even = [1 / p] * p, [prof.act_bytes] * (p - 1)
    if not prof.model or prof.family != "pipeline":
        return even
    micro = max(prof.global_batch // chunks, 1)
    measure = micro if here else 0
    try:
        balance = stage_balance(prof.model, p, prof.options, measure)
        base = stage_balance(prof.model, prof.world, prof.options, measure)
    except ValueError:  # no module.net to cut: the strategy cut at split points of its own
        return even
    measured = (base, prof.stage_s) if len(prof.stage_s) == len(base) else None
    shares = stage_shares(prof.model, balance, measure, measured)
    return shares, cut_bytes(prof.model, balance, micro)
