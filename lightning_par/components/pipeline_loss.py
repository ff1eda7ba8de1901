"""The loss the pipeline schedules past GPipe compute per micro-batch, and its target.

1F1B, interleaved 1F1B and zero bubble run each micro-batch's backward as soon as its
forward is done, so they need the loss *per micro-batch* inside the schedule, as
``torch.distributed.pipelining``'s schedules take ``loss_fn(output, target)`` with the
target given to ``step(target=...)`` apart from the inputs. Here:

* the loss is the strategy's ``loss_fn`` if given, else ``module.<loss_attr>`` (default
  ``module.criterion``) if the LightningModule has one (:func:`resolve_loss`); it must be a
  *mean* over the samples (``nn.CrossEntropyLoss()``, not ``reduction="sum"``), since the
  batch's mean loss is the size-weighted sum of the micro-batches' means;
* the target is ``batch[target_index]`` (default 1: batches ``(x, y, ...)``; 2 for
  ``(index, x, y)``; a key for a dict batch), cut into micro-batches along its batch
  dimension (:func:`batch_target`);
* the loss Lightning logs is still the user's ``training_step``'s, computed on the joined
  output (equal to one process's); the schedule's per-micro-batch loss only drives backward.
  So the two must be the same loss: at every step the loss ``training_step`` returned is
  compared with the schedule's (:func:`gather_losses`, :func:`check_returned_loss`), and a
  step whose loss differs (an extra regularisation term, label smoothing, a weight, a sum)
  is refused on every stage, as it would train ``loss_fn``'s gradients, not the user's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_par.pipeline.schedules import Schedule

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def check_loss_options(loss_fn: Any, target_index: Any) -> None:
    """Constructor arguments: ``loss_fn`` callable or ``None``, ``target_index`` int or str."""
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a callable (output, target) -> mean loss: {loss_fn!r}")
    if isinstance(target_index, bool) or not isinstance(target_index, (int, str)):
        raise TypeError(f"target_index must be an int (or a key of a dict batch): {target_index!r}")


def resolve_loss(module: pl.LightningModule | None, loss_fn: Any, loss_attr: str) -> Any:
    """``loss_fn`` if given, else ``module.<loss_attr>`` (``None`` if it has none)."""
    if loss_fn is not None:
        return loss_fn
    return getattr(module, loss_attr, None) if module is not None else None


def loss_name(loss_fn: Any, loss_attr: str) -> str:
    """How the messages name the loss of the schedules past GPipe."""
    if loss_fn is None:
        return f"`module.{loss_attr}`"
    return f"loss_fn={getattr(loss_fn, '__qualname__', None) or repr(loss_fn)}"


def check_loss(who: str, schedule: Schedule, module: Any, loss_fn: Any, loss_attr: str) -> None:
    """Refuse a schedule past GPipe without a mean-reduced loss (before launch)."""
    found = resolve_loss(module, loss_fn, loss_attr)
    if callable(found) and getattr(found, "reduction", "mean") == "mean":
        return
    where = "loss_fn" if loss_fn is not None else f"`module.{loss_attr}`"
    raise TypeError(
        f"{who}(schedule={schedule.name!r}) computes the loss per micro-batch with a mean-reduced "
        f"loss of (output, target); {where} is {found!r}. Pass loss_fn=nn.CrossEntropyLoss() "
        f"(or any mean loss of (output, target)) to the strategy, or set `module.{loss_attr}`"
        "; the target is batch[target_index] (target_index=1). Or use schedule='gpipe', "
        "which needs no loss"
    )


def batch_target(batch: Any, target_index: int | str, who: str, schedule: Schedule) -> torch.Tensor:
    """``batch[target_index]``, a tensor (else a clear error naming the strategy)."""
    try:
        if isinstance(batch, torch.Tensor):
            raise KeyError(target_index)
        target = batch[target_index]
    except (KeyError, IndexError, TypeError):
        kind = "dict with keys " + str(list(batch)) if isinstance(batch, Mapping) else (
            f"{type(batch).__name__} of {len(batch)}" if hasattr(batch, "__len__") else
            type(batch).__name__)  # fmt: skip
        raise TypeError(
            f"{who}(schedule={schedule.name!r}) takes the target of the loss per micro-batch from "
            f"batch[target_index] = batch[{target_index!r}], and the batch is a {kind}: pass "
            "target_index=<position or key of the target in your batch>"
        ) from None
    if not isinstance(target, torch.Tensor):
        raise TypeError(
            f"{who}(schedule={schedule.name!r}): batch[{target_index!r}] is a "
            f"{type(target).__name__}, not the target tensor: pass target_index=<position or "
            "key of the target in your batch>"
        )
    return target


def loss_tolerance(low_precision: bool) -> tuple[float, float]:
    """``(rtol, atol)`` within which the loss ``training_step`` returned counts as the
    schedule's; ``low_precision``: either loss is a 16-bit tensor.

    The schedule's loss is the size-weighted sum of the micro-batches' means of the very
    output values the user's loss sees on the joined output, so the same loss differs only
    by the order of its float32 sums (a few units in the last place, ~1e-7): ``rtol=1e-4``
    leaves a thousandfold margin and still catches a term worth 0.01% of the loss (label
    smoothing 0.1 moves an untrained classifier's loss by ~0.2%). That holds under
    ``bf16-mixed`` too, as autocast computes the losses (cross entropy, MSE, ...) in
    float32 from the same bfloat16 outputs. A loss *returned* in bfloat16/float16 (a loss
    computed by hand under autocast, or ``bf16-true``) has an 8-bit (11-bit) significand
    that rounds by up to 4e-3 each time, and one mean over the batch rounds otherwise than
    a sum of micro-batch means: ``rtol=1e-2``. ``atol`` covers losses near zero, whose
    rounding is relative to their terms, not to their value."""
    return (1e-2, 1e-3) if low_precision else (1e-4, 1e-6)


def _low(t: torch.Tensor | None) -> bool:
    return t is not None and t.dtype in (torch.float16, torch.bfloat16)


def gather_losses(
    returned: torch.Tensor, computed: torch.Tensor | None, size: int, group: Any = None
) -> torch.Tensor:
    """Every stage's ``[loss training_step returned (as given to backward), the schedule's
    batch loss (NaN where the stage holds no last stage), 1 if either is 16-bit]``: a
    ``(size, 3)`` float64 CPU table, the same on every stage (one all-gather of three
    numbers; every stage calls it)."""
    mine = returned.detach().reshape(()).to(torch.float64)
    theirs = torch.full_like(mine, float("nan")) if computed is None else computed.detach()
    low = torch.full_like(mine, float(_low(returned) or _low(computed)))
    row = torch.stack([mine, theirs.reshape(()).to(mine), low])
    if size == 1:
        return row[None].cpu()
    table = [torch.empty_like(row) for _ in range(size)]
    dist.all_gather(table, row, group=group)
    return torch.stack(table).cpu()


def check_returned_loss(
    table: torch.Tensor, scale: float, *, who: str, schedule: Schedule, loss: str
) -> None:
    """Raise on every stage (each holds the same ``table`` of :func:`gather_losses`) if a
    stage's ``training_step`` returned another loss than the schedule back-propagated.

    ``scale``: Lightning's ``1 / accumulate_grad_batches``, by which it divides the returned
    loss before backward (and the schedule its gradients); ``loss``: what computed the
    schedule's loss, for the message. Non-finite values (a diverged loss) are not compared."""
    computed = [float(v) for v in table[:, 1] if torch.isfinite(v)]
    if not computed:
        return
    expected = computed[0]  # one stage holds the last stage: it computed the batch loss
    low = bool(table[:, 2].max() > 0)
    rtol, atol = loss_tolerance(low)
    for stage, value in enumerate(float(v) / scale for v in table[:, 0]):
        finite = torch.isfinite(torch.tensor(value))
        if finite and abs(value - expected) > rtol * max(abs(value), abs(expected)) + atol:
            raise ValueError(
                f"{who}(schedule={schedule.name!r}) back-propagates the loss it computes per "
                f"micro-batch with {loss}, {expected:.8g} on this batch, but training_step "
                f"returned {value:.8g} (or passed it to manual_backward; on pipeline stage "
                f"{stage}; the tolerance is relative "
                f"{rtol:g} for {'16-bit' if low else 'float32'} losses): the weights would "
                f"follow {loss}'s gradients, not those of the loss you return. Pass loss_fn "
                "equal to what training_step returns, compute extra terms (regularisation, "
                "label smoothing, loss weights) inside loss_fn, or use schedule='gpipe', "
                "which backpropagates your own loss"
            )
