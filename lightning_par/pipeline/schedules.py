"""Every pipeline schedule as one object, found by its name once (as torch's
``torch.distributed.pipelining.schedules.get_schedule_class`` turns a name into a class).

A :class:`Schedule` knows what the rest of the project asks a schedule, besides running it:

* its step lists, one per device (:meth:`~Schedule.steps`, from the generators of
  :mod:`.schedule`, :mod:`.schedules_v` and :mod:`.schedules_zbv`);
* where its stages live (:meth:`~Schedule.stages_per_device`, :meth:`~Schedule.placement`);
* whether each backward is split into B and W (:attr:`~Schedule.split_backward`);
* whether the loss is computed per micro-batch inside the schedule
  (:attr:`~Schedule.loss_per_micro_batch`: the backwards start before the last forward);
* its default re-materialisation and the ones it refuses
  (:attr:`~Schedule.default_checkpoint`, :meth:`~Schedule.check_checkpoint`);
* the micro-batch counts it runs (:meth:`~Schedule.check_chunks`) and its textbook bubble
  (:meth:`~Schedule.bubble`).

=============== ================== =========== ===== ==================== ==================
name            stages per device  placement   B / W loss per micro-batch default checkpoint
=============== ================== =========== ===== ==================== ==================
``gpipe``       1                  round-robin no    no                   ``"except_last"``
``1f1b``        1                  round-robin no    yes                  ``"except_last"``
``interleaved`` ``virtual_stages`` round-robin no    yes                  ``"except_last"``
``zero_bubble`` 1                  round-robin yes   yes                  ``"never"``
``zbv``         2                  V           yes   yes                  ``"never"``
=============== ================== =========== ===== ==================== ==================

A name is looked up in :data:`SCHEDULES` where the user's argument enters (:func:`get_schedule`
here and in the functions below that take a name; the strategies' options in
:mod:`lightning_par.components.pipeline_options`); everything after holds the object.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable
from typing import ClassVar

from lightning_par.pipeline.schedule import (
    Step,
    gpipe_steps,
    one_f_one_b_steps,
    unit_time_table,
)
from lightning_par.pipeline.schedules_v import (
    check_interleaved_chunks,
    check_sizes,
    device_of,
    greedy_order,
    interleaved_steps,
)
from lightning_par.pipeline.schedules_zbv import v_device_of, zbv_bubble, zbv_order


class Schedule(abc.ABC):
    """One pipeline schedule (see the module docstring); each has one instance, in
    :data:`SCHEDULES`. ``K``: devices, ``M``: micro-batches (``chunks``), ``v``: stages per
    device."""

    #: the name a user passes (``schedule="1f1b"``)
    name: ClassVar[str]
    #: torch.distributed.pipelining's class of the same kind (the benchmark's peer)
    torch_peer: ClassVar[str]
    #: the backwards start before the last forward: the loss is computed per micro-batch
    #: inside the schedule (``loss_fn``, :mod:`lightning_par.components.pipeline_loss`)
    loss_per_micro_batch: ClassVar[bool] = True
    #: each backward is split into B (input gradient) and W (weight gradient)
    split_backward: ClassVar[bool] = False
    #: holds the user's ``virtual_stages`` stages per device
    takes_virtual_stages: ClassVar[bool] = False
    #: stages laid out in a V (device ``d`` holds ``d`` and ``2K-1-d``), not round-robin
    v_shape: ClassVar[bool] = False

    def __repr__(self) -> str:
        return f"get_schedule({self.name!r})"

    def __reduce__(self) -> tuple:  # a spawned rank unpickles the registry's own object
        return get_schedule, (self.name,)

    @property
    def default_checkpoint(self) -> str:
        """torchgpipe's ``"except_last"``; ``"never"`` where W reuses what B saved."""
        return "never" if self.split_backward else "except_last"

    @property
    def sends_both_ways(self) -> bool:
        """Whether a stage sends an activation while its neighbour sends it a gradient (the
        backwards start before the last forward), which NCCL point-to-point serialises."""
        return self.loss_per_micro_batch

    def stages_per_device(self, virtual_stages: int = 1) -> int:
        """Stages each device holds, given the user's ``virtual_stages``."""
        return virtual_stages if self.takes_virtual_stages else 1

    def placement(self, num_devices: int) -> Callable[[int], int]:
        """``device_of(stage)``: stages dealt round-robin (Megatron's layout)."""
        return functools.partial(device_of, num_devices=num_devices)

    @abc.abstractmethod
    def steps(self, num_devices: int, chunks: int, virtual_stages: int = 1) -> list[list[Step]]:
        """Every device's ordered step list; a step names a stage of the whole model."""

    def bubble(self, num_devices: int, chunks: int, virtual_stages: int = 1) -> float:
        """The textbook idle fraction (equal stages, free messages): ``(K-1)/(M+K-1)``."""
        return (num_devices - 1) / (chunks + num_devices - 1)

    def check_chunks(  # noqa: B027  (any count runs, but where a subclass says otherwise)
        self, chunks: int, num_devices: int, plugin: str | None = None
    ) -> None:
        """Refuse a micro-batch count this schedule cannot run on ``num_devices``."""

    def check_checkpoint(self, checkpoint: str, plugin: str) -> None:
        """Refuse re-materialisation where the weight-gradient step needs what B saved."""
        if self.split_backward and checkpoint != "never":
            raise ValueError(
                f"{plugin}: schedule={self.name!r} refuses checkpoint={checkpoint!r}: its "
                "weight-gradient step W reuses the activations the input-gradient step B used, "
                "so re-materialising would run each forward twice more; use checkpoint='never' "
                "(or leave it out), or schedule='interleaved' to re-materialise"
            )


class GPipe(Schedule):
    """GPipe (Huang et al., 2019): every forward, then every backward in reverse; the last
    stage applies any loss to the joined output, so nothing asks for a loss per micro-batch."""

    name, torch_peer = "gpipe", "ScheduleGPipe"
    loss_per_micro_batch = False

    def steps(self, num_devices: int, chunks: int, virtual_stages: int = 1) -> list[list[Step]]:
        return [gpipe_steps(d, num_devices, chunks) for d in range(num_devices)]


class OneFOneB(Schedule):
    """1F1B (PipeDream-flush; Narayanan et al., 2021): warm-up forwards, then one forward and
    one backward in turn; GPipe's bubble, at most ``K - s`` micro-batches held on stage s."""

    name, torch_peer = "1f1b", "Schedule1F1B"

    def steps(self, num_devices: int, chunks: int, virtual_stages: int = 1) -> list[list[Step]]:
        return [one_f_one_b_steps(d, num_devices, chunks) for d in range(num_devices)]


class Interleaved(Schedule):
    """Interleaved 1F1B (Narayanan et al., 2021, arXiv:2104.04473, section 2.2.2): ``v``
    stages per device dealt round-robin, ``chunks`` a multiple of the devices;
    bubble ``(K-1)/(vM+K-1)`` (:func:`.schedules_v.interleaved_steps`)."""

    name, torch_peer = "interleaved", "ScheduleInterleaved1F1B"
    takes_virtual_stages = True

    def steps(self, num_devices: int, chunks: int, virtual_stages: int = 1) -> list[list[Step]]:
        k, v = num_devices, virtual_stages
        return [interleaved_steps(d, k, v, chunks) for d in range(k)]

    def bubble(self, num_devices: int, chunks: int, virtual_stages: int = 1) -> float:
        return (num_devices - 1) / (virtual_stages * chunks + num_devices - 1)

    def check_chunks(self, chunks: int, num_devices: int, plugin: str | None = None) -> None:
        check_interleaved_chunks(chunks, num_devices, plugin)


class ZeroBubble(Schedule):
    """Zero bubble, ZB-H1 (Qi et al., 2023, arXiv:2401.10241): one stage per device, each
    backward split into B and W, the W filling the drain; bubble ``(K-1)/(3M+K-1)`` with equal
    F, B, W costs (:func:`.schedules_v.greedy_order`)."""

    name, torch_peer = "zero_bubble", "ScheduleInterleavedZeroBubble"
    split_backward = True

    def steps(self, num_devices: int, chunks: int, virtual_stages: int = 1) -> list[list[Step]]:
        if virtual_stages != 1:
            raise ValueError("schedule='zero_bubble' is ZB-H1, one stage per device: "
                             f"use virtual_stages=1, not {virtual_stages}")  # fmt: skip
        check_sizes(num_devices, 1, chunks)
        return greedy_order(num_devices, chunks)

    def bubble(self, num_devices: int, chunks: int, virtual_stages: int = 1) -> float:
        return (num_devices - 1) / (3 * chunks + num_devices - 1)


class ZeroBubbleV(Schedule):
    """ZBV (Qi et al., 2024, arXiv:2405.15362): zero bubble with two stages per device laid
    out in a V, bubble ``(K-1)/(6M+K-1)`` (:mod:`.schedules_zbv`). The strategies deal stages
    round-robin and refuse it; :func:`~lightning_par.pipeline.step.scheduled_step` runs it."""

    name, torch_peer = "zbv", "ScheduleZBVZeroBubble"
    split_backward = v_shape = True

    def stages_per_device(self, virtual_stages: int = 1) -> int:
        return 2

    def placement(self, num_devices: int) -> Callable[[int], int]:
        """``device_of(stage)`` in the V (:func:`.schedules_zbv.v_device_of`)."""
        return functools.partial(v_device_of, num_devices=num_devices)

    def steps(self, num_devices: int, chunks: int, virtual_stages: int = 1) -> list[list[Step]]:
        if virtual_stages != 2:
            raise ValueError("schedule='zbv' holds two stages per device (the V): use "
                             f"virtual_stages=2, not {virtual_stages}")  # fmt: skip
        check_sizes(num_devices, 2, chunks)
        return zbv_order(num_devices, chunks)

    def bubble(self, num_devices: int, chunks: int, virtual_stages: int = 1) -> float:
        return zbv_bubble(num_devices, chunks)


GPIPE, ONE_F_ONE_B, INTERLEAVED = GPipe(), OneFOneB(), Interleaved()
ZERO_BUBBLE, ZBV = ZeroBubble(), ZeroBubbleV()
#: every schedule by name: the one place a schedule's name is looked up
SCHEDULES: dict[str, Schedule] = {
    s.name: s for s in (GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE, ZBV)
}


def get_schedule(schedule: str | Schedule) -> Schedule:
    """The schedule called ``schedule`` (a :class:`Schedule` is returned as it is)."""
    if isinstance(schedule, Schedule):
        return schedule
    found = SCHEDULES.get(schedule) if isinstance(schedule, str) else None
    if found is None:
        raise ValueError(f"unknown schedule {schedule!r}: choose one of {tuple(SCHEDULES)}")
    return found


# ---- the same, for a name: what the course, the tests and the benchmark call -----------------
def device_schedule(
    schedule: str | Schedule, num_devices: int, chunks: int, virtual_stages: int = 1
) -> list[list[Step]]:
    """Every device's step list under ``schedule`` (:meth:`Schedule.steps`; ZBV:
    ``virtual_stages`` must be 2, zero bubble 1)."""
    return get_schedule(schedule).steps(num_devices, chunks, virtual_stages)


def schedule_steps(schedule: str | Schedule, num_stages: int, chunks: int) -> list[list[Step]]:
    """Every stage's step list, one stage per device."""
    return device_schedule(schedule, num_stages, chunks)


def placement(schedule: str | Schedule, num_devices: int) -> Callable[[int], int]:
    """``device_of(stage)`` under ``schedule`` (:meth:`Schedule.placement`)."""
    return get_schedule(schedule).placement(num_devices)


def formula_bubble(
    schedule: str | Schedule, num_devices: int, chunks: int, virtual_stages: int = 1
) -> float:
    """The textbook idle fraction of ``schedule`` (:meth:`Schedule.bubble`)."""
    return get_schedule(schedule).bubble(num_devices, chunks, virtual_stages)


def clock_table(schedule: str | Schedule, num_stages: int, chunks: int) -> list[list[Step | None]]:
    """``schedule`` on an ideal machine, one time slot per step
    (:func:`~lightning_par.pipeline.schedule.unit_time_table`): GPipe's and 1F1B's
    diagrams."""
    found = get_schedule(schedule)
    if found.split_backward:
        raise ValueError(
            f"clock_table replays whole backwards; schedule={found.name!r} splits them into B "
            "and W: replay it with lightning_par.pipeline.validate.simulate"
        )
    return unit_time_table(schedule_steps(found, num_stages, chunks))
