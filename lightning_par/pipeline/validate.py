"""Check a pipeline schedule before it runs: every rule, with the step that breaks it.

:func:`validate` takes one step list per device (the schedule functions of
:mod:`.schedule` and :mod:`.schedules_v` produce them; a student may write one by hand)
and raises :class:`ScheduleError` naming the first step that breaks a rule:

1. **complete**: each device runs only stages it holds; each (stage, micro-batch) has one
   forward and either one whole backward or one input-gradient B and one weight-gradient W;
2. **local order**: on its device a micro-batch's backward comes after its forward, W after B;
3. **matched messages**: the runtime sends asynchronously and receives in schedule order,
   one queue per (sender, receiver, kind) as gloo/NCCL match messages of one tag in
   order; so the receiver must ask for activations (gradients) from a peer in the order
   the peer sends them, or it would take another micro-batch's tensor;
4. **dependencies, no deadlock**: the forward of micro-batch i on stage s needs the one on
   s-1; its backward (B) needs the backward of stage s+1 (the last stage: its own forward).
   :func:`simulate` replays the lists, each step starting once its device is free and its
   inputs arrived (sends never block, a receive blocks); if every unfinished device waits,
   the schedule deadlocks and the error lists what each device waits for.

One device runs one step at a time by construction (a list per device). torch validates its
schedules the same way in ``test/distributed/pipelining/test_schedule.py`` (it simulates
the per-rank action lists, ``_simulate_comms_compute``, and checks each rank's actions);
this is our own, smaller version with messages for students.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_par.pipeline.schedule import Step

#: default step costs: a backward costs two forwards, split evenly into B and W
COSTS = {"fwd": 1.0, "bwd": 2.0, "bwd_input": 1.0, "bwd_weight": 1.0}


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message names the device, its step and the rule."""


@dataclass(frozen=True)
class Timed:
    device: int
    step: Step
    start: float
    end: float


def _where(device: int, index: int, step: Step) -> str:
    return f"device {device}, step #{index} ({step}: {step.describe()})"


def _receives(step: Step, num_stages: int) -> tuple[str, int] | None:
    """(kind, stage it comes from) of the message ``step`` waits for, if any."""
    if step.op == "fwd":
        return ("activation", step.stage - 1) if step.stage > 0 else None
    if step.op in ("bwd", "bwd_input"):
        return ("gradient", step.stage + 1) if step.stage < num_stages - 1 else None
    return None


def _sends(step: Step, num_stages: int) -> tuple[str, int] | None:
    """(kind, stage it goes to) of the message ``step`` sends, if any."""
    if step.op == "fwd":
        return ("activation", step.stage + 1) if step.stage < num_stages - 1 else None
    if step.op in ("bwd", "bwd_input"):
        return ("gradient", step.stage - 1) if step.stage > 0 else None
    return None


def _dependency(step: Step, num_stages: int) -> tuple[str, int, int] | None:
    """(op, stage, micro-batch) that must finish before ``step`` starts (across stages)."""
    if step.op == "fwd":
        return ("fwd", step.stage - 1, step.micro_batch) if step.stage > 0 else None
    if step.op in ("bwd", "bwd_input"):
        if step.stage == num_stages - 1:
            return ("fwd", step.stage, step.micro_batch)
        return ("bwd", step.stage + 1, step.micro_batch)  # "bwd" or "bwd_input" there
    return ("bwd", step.stage, step.micro_batch)  # W after this stage's B


def _check_complete(steps: Sequence[Sequence[Step]], num_stages: int, chunks: int,
                    device_of: Callable[[int], int]) -> None:  # fmt: skip
    seen: dict[tuple[str, int, int], tuple[int, int]] = {}
    for d, lst in enumerate(steps):
        for n, step in enumerate(lst):
            if step.op not in COSTS:
                raise ScheduleError(f"{_where(d, n, step)}: unknown op {step.op!r}")
            if not (0 <= step.stage < num_stages and 0 <= step.micro_batch < chunks):
                raise ScheduleError(
                    f"{_where(d, n, step)}: stage or micro-batch out of range "
                    f"({num_stages} stages, {chunks} micro-batches)"
                )
            if device_of(step.stage) != d:
                raise ScheduleError(
                    f"{_where(d, n, step)}: stage {step.stage} lives on device "
                    f"{device_of(step.stage)}, not {d}"
                )
            key = (step.op, step.stage, step.micro_batch)
            if key in seen:
                raise ScheduleError(f"{_where(d, n, step)}: runs twice (first at step "
                                    f"#{seen[key][1]})")  # fmt: skip
            seen[key] = (d, n)
            back = "bwd" if step.op in ("bwd_input", "bwd_weight") else "bwd_input"
            if step.op != "fwd" and (back, step.stage, step.micro_batch) in seen:
                raise ScheduleError(f"{_where(d, n, step)}: mixes a whole backward with the "
                                    "split B/W backward of the same micro-batch")  # fmt: skip
            if step.op != "fwd" and ("fwd", step.stage, step.micro_batch) not in seen:
                raise ScheduleError(f"{_where(d, n, step)}: comes before the forward of "
                                    f"micro-batch {step.micro_batch} on its device")  # fmt: skip
            if step.op == "bwd_weight" and ("bwd_input", step.stage, step.micro_batch) not in seen:
                raise ScheduleError(f"{_where(d, n, step)}: W before its B (the weight "
                                    "gradient needs the output gradient B received)")  # fmt: skip
    for s in range(num_stages):
        for i in range(chunks):
            missing = [op for op in ("fwd",) if (op, s, i) not in seen]
            if ("bwd", s, i) not in seen:
                missing += [op for op in ("bwd_input", "bwd_weight") if (op, s, i) not in seen]
                if len(missing) == 2 and ("fwd", s, i) in seen:
                    missing = ["bwd"]
            if missing:
                raise ScheduleError(
                    f"device {device_of(s)} never runs the {Step(s, missing[0], i).describe()}"
                )


def _check_message_order(steps: Sequence[Sequence[Step]], num_stages: int,
                         device_of: Callable[[int], int]) -> None:  # fmt: skip
    sent: dict[tuple[int, int, str], list[tuple[int, int]]] = {}
    for d, lst in enumerate(steps):
        for step in lst:
            out = _sends(step, num_stages)
            if out is not None and device_of(out[1]) != d:
                sent.setdefault((d, device_of(out[1]), out[0]), []).append(
                    (out[1], step.micro_batch)
                )
    got: dict[tuple[int, int, str], int] = {}
    for d, lst in enumerate(steps):
        for n, step in enumerate(lst):
            need = _receives(step, num_stages)
            if need is None or device_of(need[1]) == d:
                continue
            key = (device_of(need[1]), d, need[0])
            k = got.get(key, 0)
            got[key] = k + 1
            if sent[key][k] != (step.stage, step.micro_batch):
                stage, mb = sent[key][k]
                raise ScheduleError(
                    f"{_where(d, n, step)}: its {need[0]} receive from device {key[0]} would get "
                    f"the {need[0]} for micro-batch {mb} of stage {stage}, which device {key[0]} "
                    f"sends first (messages of one kind between two devices arrive in order)"
                )


def simulate(steps: Sequence[Sequence[Step]], num_stages: int,
             costs: dict[str, float] | None = None,
             durations: Sequence[Sequence[float]] | None = None) -> list[Timed]:  # fmt: skip
    """Start and end time of every step: a device runs its list in order, each step as soon
    as the device is free and the step it depends on ended (messages take no time).
    A step costs ``costs[op]``, or, given ``durations`` (one list per device, aligned with
    its steps, e.g. measured from a trace), its own duration.
    Raises :class:`ScheduleError` on a deadlock."""
    costs = {**COSTS, **(costs or {})}
    if durations is not None and [len(d) for d in durations] != [len(lst) for lst in steps]:
        raise ValueError("durations must hold one number per step of each device")
    end: dict[tuple[str, int, int], float] = {}
    free, pos = [0.0] * len(steps), [0] * len(steps)
    timed: list[Timed] = []
    progress = True
    while progress:
        progress = False
        for d, lst in enumerate(steps):
            while pos[d] < len(lst):
                step = lst[pos[d]]
                dep = _dependency(step, num_stages)
                ready = 0.0
                if dep is not None:  # a B is also recorded as "bwd" for what depends on it
                    if dep not in end:
                        break
                    ready = end[dep]
                start = max(free[d], ready)
                free[d] = start + (costs[step.op] if durations is None else durations[d][pos[d]])
                key = ("bwd" if step.op == "bwd_input" else step.op, step.stage, step.micro_batch)
                end[key] = end[(step.op, step.stage, step.micro_batch)] = free[d]
                timed.append(Timed(d, step, start, free[d]))
                pos[d] += 1
                progress = True
    stuck = [d for d, lst in enumerate(steps) if pos[d] < len(lst)]
    if stuck:
        waits = "; ".join(
            f"{_where(d, pos[d], steps[d][pos[d]])} waits for the "
            f"{_describe_dep(steps[d][pos[d]], num_stages)}"
            for d in stuck
        )
        raise ScheduleError(f"deadlock: every unfinished device waits for another: {waits}")
    return timed


def _describe_dep(step: Step, num_stages: int) -> str:
    op, stage, mb = _dependency(step, num_stages)
    return Step(stage, op, mb).describe()


def validate(steps: Sequence[Sequence[Step]], num_stages: int | None = None,
             chunks: int | None = None, device_of: Callable[[int], int] | None = None,
             costs: dict[str, float] | None = None) -> list[Timed]:  # fmt: skip
    """Check ``steps`` (one list per device) against every rule of the module docstring;
    return the simulated timing (see :func:`simulate`) or raise :class:`ScheduleError`.

    ``num_stages`` and ``chunks`` default to what the steps mention; ``device_of(stage)``
    to round-robin dealing over the devices (stage ``s`` on device ``s % len(steps)``)."""
    if not steps or not all(isinstance(lst, Sequence) for lst in steps):
        raise ScheduleError("a schedule is a list with one list of steps per device")
    flat = [s for lst in steps for s in lst]
    if not all(isinstance(s, Step) for s in flat):
        raise ScheduleError("every step must be a Step(stage, op, micro_batch)")
    num_stages = num_stages or max(s.stage for s in flat) + 1
    chunks = chunks or max(s.micro_batch for s in flat) + 1
    device_of = device_of or (lambda s: s % len(steps))
    _check_complete(steps, num_stages, chunks, device_of)
    _check_message_order(steps, num_stages, device_of)
    return simulate(steps, num_stages, costs)


def simulated_bubble(timed: Sequence[Timed], num_devices: int) -> float:
    """Idle share of the devices from the first step to the last: 1 - busy / (K * span)."""
    span = max(t.end for t in timed) - min(t.start for t in timed)
    busy = sum(t.end - t.start for t in timed)
    return 1.0 - busy / (num_devices * span)
