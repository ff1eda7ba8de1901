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
  out in a V (device ``d`` holds stages ``d`` and ``2K-1-d``), in :mod:`.schedules_zbv`;
  bubble ``(K-1)/(6M+K-1)`` with equal F, B, W costs.

torch's ``torch.distributed.pipelining.schedules`` builds the same kinds of per-rank action
lists (``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``); this module is our
own construction, checked by :mod:`lightning_par.pipeline.validate`. Each schedule, with its
placement, bubble and rules, is one object of :mod:`.schedules`, which calls these functions.
"""

from __future__ import annotations

from lightning_par.pipeline.schedule import Step, one_f_one_b_steps


def device_of(stage: int, num_devices: int) -> int:
    """The device holding ``stage`` when stages are dealt round-robin (Megatron's layout)."""
    return stage % num_devices


def check_sizes(num_devices: int, virtual_stages: int, chunks: int) -> None:
    """Devices, stages per device and micro-batches are positive integers."""
    for name, value in (("devices", num_devices), ("virtual_stages", virtual_stages),
                        ("chunks", chunks)):  # fmt: skip
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_interleaved_chunks(chunks: int, num_devices: int, plugin: str | None = None) -> None:
    """Megatron's rule: ``chunks`` a multiple of the devices (a partial last group can
    deadlock; see the module docstring). ``plugin`` names the strategy in the message."""
    k = num_devices
    if chunks % k:
        who = f"{plugin}: " if plugin else ""
        up, down = chunks + k - chunks % k, max(k, chunks - chunks % k)
        raise ValueError(
            f"{who}schedule='interleaved' needs chunks to be a multiple of the {k} devices "
            f"(Megatron's rule: micro-batches go round the stages in groups of {k}), got "
            f"chunks={chunks}: use chunks={up} or {down}"
        )


def interleaved_steps(
    device: int, num_devices: int, virtual_stages: int, chunks: int
) -> list[Step]:
    """Interleaved 1F1B on ``device`` (Megatron-LM's order; see the module docstring)."""
    check_sizes(num_devices, virtual_stages, chunks)
    k, v = num_devices, virtual_stages
    if v == 1:
        return one_f_one_b_steps(device, k, chunks)
    check_interleaved_chunks(chunks, k)
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
