"""Which Lightning features the parameter-server strategies run, and how (checked before
launch, so a refusal names the strategy and the feature before any process starts).

* gradient clipping (``gradient_clip_val``, by norm or by value): on the servers, over the
  averaged gradient (by norm: the servers exchange their shards' squared norms), exact
  against one process; ``async_sgd`` with ``staleness != 0`` clips each worker's gradient
  at the worker before its push (what one process on that batch does);
* ``bf16-mixed``: the workers compute in autocast, their weights and gradients stay fp32,
  so the servers keep fp32 weights and optimiser state: nothing changes for them;
* refused: manual optimisation, ``sync_batchnorm`` (its collectives would wait for the
  servers), ``16-mixed`` (a GradScaler unscales, skips steps on inf/NaN and moves its scale
  on the worker, while the servers step), true half precision (the servers would keep
  16-bit weights and optimiser state), a ``configure_gradient_clipping`` override (it would
  change only the worker's copy of the gradient, which the servers never see).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_par.paramserver.clipping import GradClip, from_trainer

#: Precisions whose weights, gradients and optimiser state are fp32.
SUPPORTED_PRECISION = ("32-true", "32", "bf16-mixed")


def check_features(
    name: str, module: pl.LightningModule | None, trainer: Any, layer_sync: Any
) -> None:
    """Everything strategy ``name`` refuses before launch (``layer_sync``: the strategy's
    ``sync_batchnorm`` plugin, or ``None``)."""
    if module is not None and not module.automatic_optimization:
        raise ValueError(
            f"{name} supports automatic optimisation only "
            "(the servers step the optimiser); manual optimisation is refused"
        )
    check_clipping(name, module)
    trainer_clip(trainer)  # a clear error for a bad gradient_clip_algorithm, here
    check_precision(name, str(getattr(trainer, "precision", "32-true")) if trainer else "32-true")
    if layer_sync is not None:  # its collectives would wait for the servers too
        raise ValueError(
            f"{name} refuses sync_batchnorm=True: SyncBatchNorm's collectives run on the "
            "process group of workers and servers, and the servers never join them; "
            "remove sync_batchnorm"
        )


def check_precision(name: str, precision: str) -> None:
    """Refuse a precision plugin the servers cannot reproduce exactly."""
    if precision in SUPPORTED_PRECISION:
        return
    if precision in ("16-mixed", "16"):
        raise ValueError(
            f"{name} refuses precision='16-mixed' (MixedPrecision with a GradScaler): the "
            "servers step the optimiser, so the scaler's unscaling, its steps skipped on "
            "inf/NaN gradients and its scale updates would have to be agreed with them; use "
            "precision='bf16-mixed' (no scaler) or '32-true'"
        )
    raise ValueError(
        f"{name} runs precision '32-true' or 'bf16-mixed' only (fp32 weights and optimiser "
        f"state on the servers), got precision={precision!r}"
    )


def check_clipping(name: str, module: pl.LightningModule | None) -> None:
    """Refuse a ``configure_gradient_clipping`` override: the servers clip, not the worker."""
    hook = "configure_gradient_clipping"
    if module is not None and is_overridden(hook, module, pl.LightningModule):
        raise ValueError(
            f"{name} cannot run {type(module).__name__}.configure_gradient_clipping: the "
            "servers clip the averaged gradient, and this hook would change only the worker's "
            "copy; remove the override and use Trainer(gradient_clip_val=..., "
            "gradient_clip_algorithm='norm' or 'value')"
        )


def trainer_clip(trainer: Any) -> GradClip | None:
    """The clipping ``trainer`` asks for (``None``: none)."""
    if trainer is None:
        return None
    return from_trainer(trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
