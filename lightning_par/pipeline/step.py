"""One pipeline training step on :class:`~lightning_par.pipeline.multistage.DeviceStages`,
for the tests, the benchmarks and the course (the strategies' networks run theirs in
:mod:`.network`).

How a batch loss maps onto micro-batches depends on the schedule:

* **GPipe** runs every forward first, so the last stage can join the micro-batch outputs and
  apply *any* loss to the whole batch; the gradient of that loss w.r.t. the joined output is
  then cut back into micro-batch pieces for the backward steps (:func:`forward_backward`).
  This is exactly the single-process gradient.
* **1F1B** and every schedule past it (interleaved 1F1B, zero bubble) start backwards before
  the last forward, so the loss must be computed per micro-batch (:func:`scheduled_step`,
  which runs GPipe's order this way too). For a *mean-reduced* loss over B samples, the
  batch loss is the size-weighted sum of micro-batch losses,
  ``L = sum_i (n_i / B) * loss(out_i, y_i)``, so each micro-batch back-propagates
  ``(n_i / B) * d loss(out_i, y_i)``: again the single-process gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from lightning_par.pipeline.microbatch import micro_batch_sizes, scatter
from lightning_par.pipeline.multistage import DeviceStages
from lightning_par.pipeline.schedule import Step
from lightning_par.pipeline.schedules import GPIPE, Schedule, get_schedule
from lightning_par.pipeline.validate import validate

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def forward_backward(
    device: DeviceStages,
    x: torch.Tensor,
    target: torch.Tensor | None,
    loss_fn: LossFn,
    chunks: int,
    schedule: str | Schedule = GPIPE,
    virtual_stages: int = 1,
) -> torch.Tensor | None:
    """Run one step's forward and backward passes on every device (each calls it with the
    same batch ``x``; only the device holding stage 0 reads its values, only the one holding
    the last stage ``target``). Under GPipe ``loss_fn`` sees the whole batch's output; under
    schedules with the loss per micro-batch it must be mean-reduced (:func:`scheduled_step`).
    Accumulates parameter gradients; returns the batch loss on the device holding the last
    stage, else None."""
    schedule = get_schedule(schedule)
    if schedule.loss_per_micro_batch:
        return scheduled_step(device, x, target, loss_fn, chunks, schedule, virtual_stages)[1]
    steps = _device_steps(device, schedule, chunks, virtual_stages)
    device.begin(x.shape, chunks)
    device.run([s for s in steps if s.op == "fwd"],
               [(t,) for t in scatter(x, chunks)] if device.is_first else None)  # fmt: skip
    loss, grads = None, None
    if device.is_last:
        joined = device.joined_output().requires_grad_(True)
        loss = loss_fn(joined, target)
        loss.backward()
        grad = joined.grad if joined.grad is not None else torch.zeros_like(joined)
        grads = torch.split(grad, micro_batch_sizes(x.shape[0], chunks))
    device.run([s for s in steps if s.op != "fwd"],
               output_grad=lambda i, outs: [grads[i]] + [None] * (len(outs) - 1))  # fmt: skip
    device.finish()
    return loss


def scheduled_step(
    device: DeviceStages,
    x: torch.Tensor | tuple[torch.Tensor, ...],
    target: torch.Tensor | None,
    loss_fn: LossFn,
    chunks: int,
    schedule: str | Schedule,
    virtual_stages: int = 1,
    scale: float = 1.0,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One training step of ``device`` under any schedule of
    :mod:`~lightning_par.pipeline.schedules` (or its name), validated before it runs,
    with the mean-reduced ``loss_fn`` per micro-batch (micro-batch ``i`` back-propagates
    ``scale * n_i / B * loss_fn(out_i, y_i)``). ``x`` is the batch (a tensor or a tuple of
    tensors that the first stage takes). Returns, on the device holding the last stage, its
    joined (first) output and the batch loss (unscaled); else ``(None, None)``. Calls
    ``device.finish()``."""
    steps = _device_steps(device, schedule, chunks, virtual_stages)
    xs = x if isinstance(x, tuple) else (x,)
    batch = xs[0].shape[0]
    sizes = micro_batch_sizes(batch, chunks)
    device.begin(tuple(xs[0].shape), chunks)
    targets = scatter(target, chunks) if device.is_last else None
    losses: list[torch.Tensor] = []

    def micro_grad(i: int, outs: tuple[torch.Tensor, ...]) -> list[torch.Tensor | None]:
        out = outs[0].detach().requires_grad_(True)
        loss = loss_fn(out, targets[i]) * (sizes[i] / batch)
        losses.append(loss.detach())
        return [torch.autograd.grad(loss * scale, out)[0]] + [None] * (len(outs) - 1)

    inputs = list(zip(*(scatter(t, chunks) for t in xs))) if device.is_first else None
    device.run(steps, inputs, output_grad=micro_grad)
    if not device.is_last:
        device.finish()
        return None, None
    joined = device.joined_output()
    device.finish()
    return joined, torch.stack(losses).sum()


def _device_steps(device: DeviceStages, schedule: str | Schedule, chunks: int,
                  virtual_stages: int) -> list[Step]:  # fmt: skip
    """This device's steps under ``schedule``, after checking it holds the stages the
    schedule places on it."""
    schedule, k = get_schedule(schedule), device.comm.world_size
    where = schedule.placement(k)
    wrong = [s for s in device.stages if where(s) != device.comm.rank]
    if wrong:
        name = schedule.name
        raise ValueError(f"schedule={name!r} places stage {wrong[0]} on device "
                         f"{where(wrong[0])}, but device {device.comm.rank} holds it: build "
                         f"DeviceStages with device_of=placement({name!r}, {k})")  # fmt: skip
    return checked_schedule(schedule, k, chunks, virtual_stages)[device.comm.rank]


@functools.lru_cache(maxsize=64)
def checked_schedule(
    schedule: str | Schedule, num_devices: int, chunks: int, virtual_stages: int = 1
) -> list[list[Step]]:
    """Every device's steps under ``schedule``, after :func:`validate` passed (cached)."""
    schedule = get_schedule(schedule)
    steps = schedule.steps(num_devices, chunks, virtual_stages)
    validate(steps, num_devices * virtual_stages, chunks, schedule.placement(num_devices))
    return steps
