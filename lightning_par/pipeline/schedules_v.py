"""Schedules past 1F1B: interleaved 1F1B and zero bubble, as per-device step lists.

A :class:`~lightning_par.pipeline.schedule.Step` here names a *stage* of the whole model
(``0 .. S-1``), not a device: with ``v`` virtual stages per device and ``K`` devices the
model is cut into ``S = v*K`` stages and device ``d`` holds stages ``d, d+K, d+2K, ...``
(:func:`device_of`), so a micro-batch visits every device ``v`` times. Ops:

* ``"fwd"`` (F), ``"bwd"`` (a whole backward, B);
* ``"bwd_input"`` (B in the zero-bubble paper: only the gradient w.r.t. the stage's input,
  which the previous stage waits for) and ``"bwd_weight"`` (W: the parameter gradients,
  which nobody waits for, so they can fill the bubble).

* **Interleaved 1F1B** (Narayanan et al., 2021, "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", arXiv:2104.04473, section 2.2.2): forwards
  go round the device's stages in groups of ``K`` micro-batches (micro-batches 0..K-1 on
  its first stage, then the same on its second stage, ...); a device runs
  ``2(K-d-1) + (v-1)K`` warm-up forwards, then alternates one forward and one backward,
  backwards visiting the stages in reverse. ``chunks`` must be a multiple of ``K`` (as in
  Megatron): each group of ``K`` micro-batches leaves stage ``s`` on the last device just
  as the first device finishes the group on stage ``s``, so the first device never waits.
  Letting the last group be partial is not safe: the validator finds deadlocks (e.g. at
  ``K = 4, v = 3, M = 5``, device 0 waits for stage 8's input while the device that would
  send it waits in turn), and where it runs the bubble exceeds the formula. Bubble
  ``(K-1)/(v*M+K-1)`` with ``t_F`` and ``t_B`` per whole model fixed (each of the ``v``
  stages of a device costs ``1/v`` of them).
* **Zero bubble, ZB-H1** (Qi et al., 2023, "Zero Bubble Pipeline Parallelism",
  arXiv:2401.10241, section 3): each backward is split into B and W; the order comes from
  :func:`greedy_order`, a list scheduler on unit-cost steps that runs a B as soon as its
  gradient arrived, else a forward within 1F1B's warm-up depth, else a pending W. Equal
  F/B/W costs give the paper's ZB-H1 bubble ``(K-1)/(3M+K-1)`` for ``M >= K``, a third of
  1F1B's idle time (the W fill the drain, where 1F1B's first stage waits).

* **ZBV** (Qi et al., 2024, arXiv:2405.15362): zero bubble with two stages per device laid
  out in a V (device ``d`` holds stages ``d`` and ``2K-1-d``, :func:`placement`), in
  :mod:`.schedules_zbv`; bubble ``(K-1)/(6M+K-1)`` with equal F, B, W costs.

torch's ``torch.distributed.pipelining.schedules`` builds the same kinds of per-rank action
lists (``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``); this module is our
own construction, checked by :mod:`lightning_par.pipeline.validate`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from lightning_par.pipeline.schedule import SCHEDULES, Step, one_f_one_b_steps, schedule_steps
from lightning_par.pipeline.schedules_zbv import v_device_of, zbv_bubble, zbv_order

NEW_SCHEDULES = ("interleaved", "zero_bubble")
#: schedules whose stages are not dealt round-robin (see :func:`placement`); ZBV's V layout
#: is not offered by the strategies, only by :class:`~lightning_par.pipeline.multistage.
#: DeviceStages`, :func:`~lightning_par.pipeline.step.scheduled_step` and the benchmark
V_SCHEDULES = ("zbv",)
#: schedules whose backward is split into B and W
SPLIT_SCHEDULES = ("zero_bubble", "zbv")
OPS = ("fwd", "bwd", "bwd_input", "bwd_weight")


def device_of(stage: int, num_devices: int) -> int:
    """The device holding ``stage`` when stages are dealt round-robin (Megatron's layout)."""
    return stage % num_devices


def placement(schedule: str, num_devices: int) -> Callable[[int], int]:
    """``device_of(stage)`` under ``schedule``: the V layout for ZBV
    (:func:`~lightning_par.pipeline.schedules_zbv.v_device_of`), round-robin otherwise."""
    if schedule in V_SCHEDULES:
        return functools.partial(v_device_of, num_devices=num_devices)
    return functools.partial(device_of, num_devices=num_devices)


def _check(num_devices: int, virtual_stages: int, chunks: int) -> None:
    for name, value in (("devices", num_devices), ("virtual_stages", virtual_stages),
                        ("chunks", chunks)):  # fmt: skip
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def interleaved_steps(
    device: int, num_devices: int, virtual_stages: int, chunks: int
) -> list[Step]:
    """Interleaved 1F1B on ``device`` (Megatron-LM's order; see the module docstring)."""
    _check(num_devices, virtual_stages, chunks)
    k, v = num_devices, virtual_stages
    if v == 1:
        return one_f_one_b_steps(device, k, chunks)
    if chunks % k:
        raise ValueError(
            f"interleaved 1F1B needs chunks to be a multiple of the {k} devices (Megatron's "
            f"rule: micro-batches go round the stages in groups of {k}); got chunks={chunks}, "
            f"use chunks={chunks + k - chunks % k} or {max(k, chunks - chunks % k)}"
        )
    total = chunks * v

    def nth(n: int, op: str) -> Step:
        group, r = divmod(n, k * v)
        chunk = r // k
        if op == "bwd":
            chunk = v - 1 - chunk
        return Step(chunk * k + device, op, group * k + r % k)

    warmup = min(2 * (k - device - 1) + (v - 1) * k, total)
    steps = [nth(n, "fwd") for n in range(warmup)]
    for n in range(total - warmup):
        steps += [nth(warmup + n, "fwd"), nth(n, "bwd")]
    return steps + [nth(n, "bwd") for n in range(total - warmup, total)]


def greedy_order(num_stages: int, chunks: int) -> list[list[Step]]:
    """Zero-bubble step lists for ``K = num_stages`` stages, one per device, from a list
    scheduler on unit-cost F, B (input gradient) and W steps with free messages.

    At every time slot device ``d`` runs, in this priority: the B of its oldest micro-batch
    whose gradient has arrived (B is on the critical path: the previous stage waits for
    it); else, if ``K`` W steps are pending, the oldest W (a cap on the activations kept for
    W); else its next forward, if its input has arrived and fewer than ``K-d`` micro-batches
    are between forward and B (1F1B's warm-up depth); else its oldest pending W; else it
    idles. For ``M >= K`` this reaches the paper's ZB-H1 bubble ``(K-1)/(3M+K-1)``; the
    deferred W keep up to about ``2K-1`` micro-batches' inputs on the first device, more
    than 1F1B's ``K`` (measured in ``python -m lightning_par.bench pipeline``)."""
    k, m = num_stages, chunks
    done: dict[tuple[str, int, int], int] = {}  # (op, stage, mb) -> slot it ran in
    next_f, next_b = [0] * k, [0] * k
    pending_w: list[list[int]] = [[] for _ in range(k)]
    order: list[list[Step]] = [[] for _ in range(k)]
    slot = 0
    while any(len(o) < 3 * m for o in order):
        chosen: list[tuple[str, int] | None] = [None] * k
        for s in range(k):
            b, f = next_b[s], next_f[s]
            grad_from = ("fwd", s, b) if s == k - 1 else ("bwd_input", s + 1, b)
            input_ready = s == 0 or done.get(("fwd", s - 1, f), slot) < slot
            if b < f and done.get(grad_from, slot) < slot:
                chosen[s] = ("bwd_input", b)
            elif len(pending_w[s]) >= k:
                chosen[s] = ("bwd_weight", pending_w[s][0])
            elif f < m and f - b < k - s and input_ready:
                chosen[s] = ("fwd", f)
            elif pending_w[s]:
                chosen[s] = ("bwd_weight", pending_w[s][0])
        for s, c in enumerate(chosen):
            if c is None:
                continue
            op, mb = c
            order[s].append(Step(s, op, mb))
            done[(op, s, mb)] = slot
            if op == "fwd":
                next_f[s] += 1
            elif op == "bwd_input":
                next_b[s] += 1
                pending_w[s].append(mb)
            else:
                pending_w[s].pop(0)
        slot += 1
    return order


def zero_bubble_steps(device: int, num_devices: int, chunks: int) -> list[Step]:
    """Zero bubble (ZB-H1 order, :func:`greedy_order`) on ``device``."""
    _check(num_devices, 1, chunks)
    return greedy_order(num_devices, chunks)[device]


def device_schedule(
    schedule: str, num_devices: int, chunks: int, virtual_stages: int = 1
) -> list[list[Step]]:
    """Every device's step list under ``schedule`` (``"gpipe"``, ``"1f1b"``,
    ``"interleaved"``, ``"zero_bubble"`` or ``"zbv"``); stages are placed by
    :func:`placement` (ZBV: ``2K`` stages in a V, ``virtual_stages`` must be 2)."""
    if schedule in SCHEDULES:
        return schedule_steps(schedule, num_devices, chunks)
    if schedule == "interleaved":
        return [
            interleaved_steps(d, num_devices, virtual_stages, chunks) for d in range(num_devices)
        ]
    if schedule == "zero_bubble":
        if virtual_stages != 1:
            raise ValueError("schedule='zero_bubble' is ZB-H1, one stage per device: "
                             f"use virtual_stages=1, not {virtual_stages}")  # fmt: skip
        return [zero_bubble_steps(d, num_devices, chunks) for d in range(num_devices)]
    if schedule == "zbv":
        if virtual_stages != 2:
            raise ValueError("schedule='zbv' holds two stages per device (the V): use "
                             f"virtual_stages=2, not {virtual_stages}")  # fmt: skip
        _check(num_devices, 2, chunks)
        return zbv_order(num_devices, chunks)
    known = SCHEDULES + NEW_SCHEDULES + V_SCHEDULES
    raise ValueError(f"unknown schedule {schedule!r}: choose one of {known}")


def formula_bubble(schedule: str, num_devices: int, chunks: int, virtual_stages: int = 1) -> float:
    """The textbook idle fraction: GPipe/1F1B ``(K-1)/(M+K-1)``, interleaved
    ``(K-1)/(v*M+K-1)``, zero bubble (ZB-H1, ``t_F = t_B = t_W``) ``(K-1)/(3M+K-1)``, ZBV
    (the same costs per stage, two stages per device) ``(K-1)/(6M+K-1)``."""
    k, m = num_devices, chunks
    if schedule == "zbv":
        return zbv_bubble(k, m)
    if schedule == "interleaved":
        return (k - 1) / (virtual_stages * m + k - 1)
    if schedule == "zero_bubble":
        return (k - 1) / (3 * m + k - 1)
    return (k - 1) / (m + k - 1)
