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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch

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


def check_loss(who: str, schedule: str, module: Any, loss_fn: Any, loss_attr: str) -> None:
    """Refuse a schedule past GPipe without a mean-reduced loss (before launch)."""
    found = resolve_loss(module, loss_fn, loss_attr)
    if callable(found) and getattr(found, "reduction", "mean") == "mean":
        return
    where = "loss_fn" if loss_fn is not None else f"`module.{loss_attr}`"
    raise TypeError(
        f"{who}(schedule={schedule!r}) computes the loss per micro-batch with a mean-reduced "
        f"loss of (output, target); {where} is {found!r}. Pass loss_fn=nn.CrossEntropyLoss() "
        f"(or any mean loss of (output, target)) to the strategy, or set `module.{loss_attr}`"
        "; the target is batch[target_index] (target_index=1). Or use schedule='gpipe', "
        "which needs no loss"
    )


def batch_target(batch: Any, target_index: int | str, who: str, schedule: str) -> torch.Tensor:
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
            f"{who}(schedule={schedule!r}) takes the target of the loss per micro-batch from "
            f"batch[target_index] = batch[{target_index!r}], and the batch is a {kind}: pass "
            "target_index=<position or key of the target in your batch>"
        ) from None
    if not isinstance(target, torch.Tensor):
        raise TypeError(
            f"{who}(schedule={schedule!r}): batch[{target_index!r}] is a "
            f"{type(target).__name__}, not the target tensor: pass target_index=<position or "
            "key of the target in your batch>"
        )
    return target
