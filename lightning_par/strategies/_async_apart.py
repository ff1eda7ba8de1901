"""What keeps ``async_sgd``'s workers out of lock-step while fitting: each worker reaches an
epoch's end on its own (a batch apart from the others, or after one is gone), so
Lightning's collectives and torchmetrics' gathers stay local to it then
(:func:`workers_apart`, :func:`keep_metrics_local`)."""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch import nn
from torchmetrics import Metric

from lightning_par import _compat


def workers_apart(module: pl.LightningModule) -> bool:
    """Training or validating inside fit: the workers are not in step (one may be a batch
    behind, or gone), so Lightning's collectives become local."""
    trainer = _compat.attached_trainer(module)
    return (
        trainer is not None
        and trainer.state.fn == TrainerFn.FITTING
        and trainer.state.stage in (RunningStage.TRAINING, RunningStage.VALIDATING)
    )


def keep_metrics_local(model: nn.Module, saved: dict[int, Callable[[], bool]], local: bool) -> None:
    """torchmetrics gather their states at ``compute`` (epoch end): not while fitting
    (``local``), where each worker's epoch ends on its own (a gather would wait for a worker
    still training, which may wait for the servers on it). ``sync_on_compute`` alone is not
    enough: ``compute`` reads what the metric's last ``forward`` took from it, and a metric
    only ``update``-d keeps syncing; whether the run is distributed is asked at every
    ``compute``, so each metric's own ``distributed_available_fn`` is kept in ``saved``
    while a local one stands in, and put back when ``local`` is off."""
    for sub in model.modules():
        if isinstance(sub, Metric):
            sub.sync_on_compute = not local
            if local:
                saved.setdefault(id(sub), sub.distributed_available_fn)
                sub.distributed_available_fn = _not_distributed
            elif id(sub) in saved:
                sub.distributed_available_fn = saved.pop(id(sub))


def _not_distributed() -> bool:
    """A metric's ``distributed_available_fn`` while ``async_sgd`` fits: gather nothing."""
    return False
