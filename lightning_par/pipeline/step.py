"""One pipeline training step, the single implementation behind the strategy, the tests and
the benchmarks.

How a batch loss maps onto micro-batches depends on the schedule:

* **GPipe** runs every forward first (:func:`forward_half`), so the last stage can join the
  micro-batch outputs and apply *any* loss to the whole batch; the gradient of that loss
  w.r.t. the joined output is then cut back into micro-batch pieces for the backward steps
  (:func:`backward_half`). This is exactly the single-process gradient.
* **1F1B** (:func:`one_f_one_b`) starts backwards before the last forward, so the loss must
  be computed per micro-batch. For a *mean-reduced* loss over B samples, the batch loss is
  the size-weighted sum of micro-batch losses, ``L = sum_i (n_i / B) * loss(out_i, y_i)``,
  so each micro-batch back-propagates ``(n_i / B) * d loss(out_i, y_i)``: again the
  single-process gradient.

:func:`scheduled_step` runs any schedule (interleaved 1F1B, zero bubble, and GPipe and
1F1B too) on a :class:`~lightning_par.pipeline.multistage.DeviceStages` with the per
micro-batch loss of 1F1B (a GPipe order there also computes the loss per micro-batch).

:func:`forward_backward` strings them together for a loss on the last stage;
:class:`~lightning_par.pipeline.sequential.PipelinedSequential` calls the halves from
Lightning's ``training_step`` and ``backward``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from lightning_par.pipeline.microbatch import micro_batch_sizes, scatter
from lightning_par.pipeline.multistage import DeviceStages
from lightning_par.pipeline.runtime import PipelineStage
from lightning_par.pipeline.schedule import Step, gpipe_steps, one_f_one_b_steps
from lightning_par.pipeline.schedules import GPIPE, Schedule, get_schedule
from lightning_par.pipeline.validate import validate

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def forward_half(
    stage: PipelineStage, x: torch.Tensor, chunks: int
) -> tuple[list[Step], torch.Tensor | None]:
    """GPipe's forward half: every micro-batch's forward on this stage. Returns the backward
    steps still to run and, on the last stage, the joined output (``None`` elsewhere)."""
    stage.begin(x.shape, chunks)
    steps = gpipe_steps(stage.stage, stage.num_stages, chunks)
    stage.run(steps[:chunks], scatter(x, chunks) if stage.is_first else None)
    return steps[chunks:], (stage.joined_output() if stage.is_last else None)


def backward_half(
    stage: PipelineStage, steps: list[Step], output_grad: torch.Tensor | None
) -> None:
    """GPipe's backward half, given the loss gradient w.r.t. the joined output on the last
    stage (``None`` elsewhere, and ``None`` on the last stage means a zero gradient)."""
    grads = None
    if stage.is_last:
        joined = stage.joined_output()
        grad = output_grad if output_grad is not None else torch.zeros_like(joined)
        grads = torch.split(grad, stage.sizes)
    stage.run(steps, output_grad=lambda i, out: grads[i])
    stage.finish()


def one_f_one_b(
    stage: PipelineStage,
    x: torch.Tensor,
    target: torch.Tensor | None,
    loss_fn: LossFn,
    chunks: int,
    scale: float = 1.0,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A whole 1F1B step with the mean-reduced ``loss_fn`` per micro-batch (micro-batch ``i``
    back-propagates ``scale * n_i / B * loss_fn(out_i, y_i)``). Returns, on the last stage,
    the joined output and the batch loss (unscaled); ``(None, None)`` elsewhere. The caller
    calls ``stage.finish()`` (after sharing the output, if it does)."""
    sizes = stage.begin(x.shape, chunks)
    targets = scatter(target, chunks) if stage.is_last else None
    batch, losses = x.shape[0], []

    def micro_grad(i: int, out: torch.Tensor) -> torch.Tensor:
        out = out.detach().requires_grad_(True)
        loss = loss_fn(out, targets[i]) * (sizes[i] / batch)
        losses.append(loss.detach())
        return torch.autograd.grad(loss * scale, out)[0]

    steps = one_f_one_b_steps(stage.stage, stage.num_stages, chunks)
    stage.run(steps, scatter(x, chunks) if stage.is_first else None, output_grad=micro_grad)
    if not stage.is_last:
        return None, None
    return stage.joined_output(), torch.stack(losses).sum()


def forward_backward(
    stage: PipelineStage,
    x: torch.Tensor,
    target: torch.Tensor | None,
    loss_fn: LossFn,
    chunks: int,
    schedule: str | Schedule = GPIPE,
) -> torch.Tensor | None:
    """Run one step's forward and backward passes on every stage (each rank calls it with
    the same batch ``x``; only stage 0 reads its values, only the last stage ``target``).
    Accumulates parameter gradients; returns the batch loss on the last stage, else None.
    A schedule with the loss per micro-batch runs as 1F1B (one stage per device)."""
    if get_schedule(schedule).loss_per_micro_batch:
        _, loss = one_f_one_b(stage, x, target, loss_fn, chunks)
        stage.finish()
        return loss
    steps, joined = forward_half(stage, x, chunks)
    loss, grad = None, None
    if stage.is_last:
        joined = joined.requires_grad_(True)
        loss = loss_fn(joined, target)
        loss.backward()
        grad = joined.grad
    backward_half(stage, steps, grad)
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
    """One training step of ``device`` (a :class:`DeviceStages`) under any schedule of
    :mod:`~lightning_par.pipeline.schedules` (or its name), validated before it runs,
    with a mean-reduced ``loss_fn`` per micro-batch as in :func:`one_f_one_b`. ``x`` is the
    batch (a tensor or a tuple of tensors that the first stage takes). Returns, on the device
    holding the last stage, its joined (first) output and the batch loss; else ``(None, None)``.
    Calls ``device.finish()``."""
    schedule, k = get_schedule(schedule), device.comm.world_size
    steps = checked_schedule(schedule, k, chunks, virtual_stages)[device.comm.rank]
    where = schedule.placement(k)
    wrong = [s for s in device.stages if where(s) != device.comm.rank]
    if wrong:
        name = schedule.name
        raise ValueError(f"schedule={name!r} places stage {wrong[0]} on device "
                         f"{where(wrong[0])}, but device {device.comm.rank} holds it: build "
                         f"DeviceStages with device_of=placement({name!r}, {k})")  # fmt: skip
    xs = x if isinstance(x, tuple) else (x,)
    batch = xs[0].shape[0]
    sizes = micro_batch_sizes(batch, chunks)
    device.begin(tuple(xs[0].shape), chunks)
    last = device.num_stages - 1 in device.stages
    targets = scatter(target, chunks) if last else None
    losses: list[torch.Tensor] = []

    def micro_grad(i: int, outs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        out = outs[0].detach().requires_grad_(True)
        loss = loss_fn(out, targets[i]) * (sizes[i] / batch)
        losses.append(loss.detach())
        return [torch.autograd.grad(loss * scale, out)[0]] + [None] * (len(outs) - 1)

    inputs = list(zip(*(scatter(t, chunks) for t in xs))) if 0 in device.stages else None
    device.run(steps, inputs, output_grad=micro_grad)
    joined = torch.cat([device.results[i][0] for i in range(chunks)]) if last else None
    device.finish()
    return (joined, torch.stack(losses).sum()) if last else (None, None)


@functools.lru_cache(maxsize=64)
def checked_schedule(
    schedule: str | Schedule, num_devices: int, chunks: int, virtual_stages: int = 1
) -> list[list[Step]]:
    """Every device's steps under ``schedule``, after :func:`validate` passed (cached)."""
    schedule = get_schedule(schedule)
    steps = schedule.steps(num_devices, chunks, virtual_stages)
    validate(steps, num_devices * virtual_stages, chunks, schedule.placement(num_devices))
    return steps
