"""Zero bubble with the V-shaped layout (ZBV), as per-device step lists.

Qi et al., 2024, "Pipeline Parallelism with Controllable Memory" (arXiv:2405.15362), and
section 6 of the zero-bubble paper (Qi et al., 2023, arXiv:2401.10241): the model is cut into
``S = 2K`` stages and device ``d`` holds stages ``d`` and ``2K-1-d`` (:func:`v_device_of`),
so a micro-batch's forward goes down the devices and comes back up (a "V"), and its
backward retraces it. Device 0 holds both the first and the last stage: the loss is
computed where the micro-batch entered, the first device starts its backwards early, and
the warm-up idle of the later devices is shorter than with round-robin stages. Backwards
are split into B (input gradient) and W (weight gradient) as in ZB-H1
(:mod:`.schedules_v`), and the W steps fill what idle time is left.

The order comes from :func:`zbv_order`, a list scheduler on unit-cost F, B and W steps with
free messages (our construction, not the paper's hand-drawn pattern; torch's
``ScheduleZBVZeroBubble`` builds its own), checked by
:mod:`lightning_par.pipeline.validate`. Its memory rule is
the paper's ZB-V one: a device keeps at most ``2K`` stage-micro-batches between forward and
B, the activations of ``K`` whole-model micro-batches, as 1F1B's first device. With equal
costs the bubble is the start-up only, device ``d`` waiting ``d`` forwards for the first
micro-batch to reach its first stage: the ideal bubble (:func:`zbv_bubble`) is
``(K-1) / (6M + K-1)`` (each device runs ``6M`` unit steps: two stages, F, B, W), which
:func:`zbv_order` reaches whenever ``M`` is a multiple of ``K`` (tests/test_pipeline_zbv.py
checks K up to 8); other ``M`` run, with a larger bubble (e.g. K = 4, M = 5).
"""

from __future__ import annotations

from lightning_par.pipeline.schedule import Step


def v_device_of(stage: int, num_devices: int) -> int:
    """The device holding ``stage`` in the V layout: stages ``d`` and ``2K-1-d`` on ``d``."""
    return stage if stage < num_devices else 2 * num_devices - 1 - stage


def _ready(done: dict[tuple[str, int, int], int], key: tuple[str, int, int], slot: int) -> bool:
    return done.get(key, slot) < slot


def zbv_order(num_devices: int, chunks: int) -> list[list[Step]]:
    """ZBV step lists, one per device, for ``K = num_devices`` and ``M = chunks``.

    At every unit time slot device ``d`` runs, in this priority: a B whose gradient has
    arrived (the oldest micro-batch; the later stage first, whose B the others wait for);
    else the oldest pending W if ``2K`` are pending (bounds the activations kept for W);
    else a forward whose input has arrived, while fewer than ``2K`` of its stage-micro-batches
    wait for their B (the later stage first, which brings a micro-batch to the loss); else
    the oldest pending W; else it idles."""
    if not isinstance(num_devices, int) or not isinstance(chunks, int):
        raise ValueError("num_devices and chunks must be integers")
    if num_devices < 1 or chunks < 1:
        raise ValueError(f"need >= 1 device and >= 1 micro-batch, got {num_devices}, {chunks}")
    k, m = num_devices, chunks
    last = 2 * k - 1
    held = [(d, last - d) for d in range(k)]
    done: dict[tuple[str, int, int], int] = {}
    next_f, next_b = [0] * (2 * k), [0] * (2 * k)
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(k)]
    order: list[list[Step]] = [[] for _ in range(k)]
    slot = 0
    while any(len(o) < 6 * m for o in order):
        chosen: list[Step | None] = [None] * k
        for d, stages in enumerate(held):
            later_first = sorted(stages, reverse=True)
            backs = [s for s in later_first if next_b[s] < next_f[s] and _ready(
                done, ("fwd", s, next_b[s]) if s == last else ("bwd_input", s + 1, next_b[s]),
                slot)]  # fmt: skip
            fwds = [s for s in later_first if next_f[s] < m and (s == 0 or _ready(
                done, ("fwd", s - 1, next_f[s]), slot))]  # fmt: skip
            waiting = sum(next_f[s] - next_b[s] for s in stages)
            if backs:
                s = min(backs, key=lambda s: next_b[s])
                chosen[d] = Step(s, "bwd_input", next_b[s])
            elif len(pending_w[d]) >= 2 * k:
                chosen[d] = Step(pending_w[d][0][0], "bwd_weight", pending_w[d][0][1])
            elif fwds and waiting < 2 * k:
                s = min(fwds, key=lambda s: next_f[s])
                chosen[d] = Step(s, "fwd", next_f[s])
            elif pending_w[d]:
                chosen[d] = Step(pending_w[d][0][0], "bwd_weight", pending_w[d][0][1])
        for d, step in enumerate(chosen):
            if step is None:
                continue
            order[d].append(step)
            done[(step.op, step.stage, step.micro_batch)] = slot
            if step.op == "fwd":
                next_f[step.stage] += 1
            elif step.op == "bwd_input":
                next_b[step.stage] += 1
                pending_w[d].append((step.stage, step.micro_batch))
            else:
                pending_w[d].pop(0)
        slot += 1
        if slot > 12 * m * k + 8 * k:  # a bug, not a schedule: every step should fit
            raise RuntimeError(f"zbv_order did not finish for K={k}, M={m}")
    return order


def zbv_bubble(num_devices: int, chunks: int) -> float:
    """The ideal ZBV bubble with equal F, B and W costs: ``(K-1)/(6M+K-1)`` (module
    docstring)."""
    k, m = num_devices, chunks
    return (k - 1) / (6 * m + k - 1)
