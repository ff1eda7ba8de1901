"""A whole training step of a pipeline, for a loss on the joined output.

How a batch loss maps onto micro-batches depends on the schedule:

* **GPipe** runs every forward first, so the last stage can join the micro-batch outputs and
  apply *any* loss to the whole batch; the gradient of that loss w.r.t. the joined output is
  then cut back into micro-batch pieces for the backward steps. This is exactly the
  single-process gradient.
* **1F1B** starts backwards before the last forward, so the loss must be computed per
  micro-batch. For a *mean-reduced* loss over B samples, the batch loss is the size-weighted
  sum of micro-batch losses, ``L = sum_i (n_i / B) * loss(out_i, y_i)``, so each micro-batch
  back-propagates ``(n_i / B) * d loss(out_i, y_i)``: again the single-process gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_par.pipeline.microbatch import scatter
from lightning_par.pipeline.runtime import PipelineStage
from lightning_par.pipeline.schedule import stage_steps

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def forward_backward(
    stage: PipelineStage,
    x: torch.Tensor,
    target: torch.Tensor | None,
    loss_fn: LossFn,
    chunks: int,
    schedule: str = "gpipe",
) -> torch.Tensor | None:
    """Run one step's forward and backward passes on every stage (each rank calls it with
    the same batch ``x``; only stage 0 reads its values, only the last stage ``target``).
    Accumulates parameter gradients; returns the batch loss on the last stage, else None."""
    sizes = stage.begin(x.shape, chunks)
    steps = stage_steps(schedule, stage.stage, stage.num_stages, chunks)
    inputs = scatter(x, chunks) if stage.is_first else None
    targets = scatter(target, chunks) if stage.is_last and target is not None else None
    loss = None
    if schedule == "gpipe":
        forwards = [s for s in steps if s.op == "fwd"]
        stage.run(forwards, inputs)
        grads = None
        if stage.is_last:
            joined = torch.cat([o.detach() for o in stage.outputs]).requires_grad_(True)
            loss = loss_fn(joined, target)
            loss.backward()
            grads = torch.split(joined.grad, sizes)
        stage.run(steps[len(forwards) :], output_grad=lambda i, out: grads[i])
    else:
        batch, losses = sum(sizes), []

        def micro_grad(i: int, out: torch.Tensor) -> torch.Tensor:
            out = out.detach().requires_grad_(True)
            micro_loss = loss_fn(out, targets[i]) * (sizes[i] / batch)
            losses.append(micro_loss.detach())
            return torch.autograd.grad(micro_loss, out)[0]

        stage.run(steps, inputs, output_grad=micro_grad)
        if stage.is_last:
            loss = torch.stack(losses).sum()
    stage.finish()
    return loss
