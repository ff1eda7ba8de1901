"""Local SGD (model averaging): each rank steps on its own shard, weights averaged now and then.

:class:`LocalSGDStrategy` is a thin adapter over
:class:`~lightning_par.strategies._base.ParStrategy`:

* no gradient synchronisation at all: ``post_backward`` does nothing and there are no
  gradient buckets; each rank's optimiser steps on its own shard's gradients;
* every ``period`` optimiser steps :func:`~lightning_par.collectives.average_parameters`
  replaces every rank's parameters and floating buffers by their mean, summed by one of
  our collectives (default ring); ``period=None`` averages once per epoch, after the
  epoch's last step, which is the course's "ParallelSGD" (000; Zinkevich et al. 2010)
  applied epoch by epoch;
* the end of ``fit`` averages whatever was stepped since the last averaging, so every rank
  (and the checkpoint or the weights returned after a fork launch) ends with the same model.

With ``period=1`` and plain SGD this is synchronous data parallelism: the mean of
``w - lr * g_r`` is ``w - lr * mean(g_r)``, what ``ring_allreduce`` computes (to float
rounding). Larger periods send ``period`` times fewer messages (Stich, "Local SGD
converges fast and communicates little", ICLR 2019).

**Optimiser state stays local.** Only weights (and floating buffers) are averaged: SGD's
momentum buffers, Adam's moments and learning-rate schedulers are each rank's own and are
never exchanged. After an averaging every rank continues with its own momentum, built from
its own shard's gradients; with ``period=1`` and momentum the result therefore differs
from synchronous data parallelism (whose momentum sees averaged gradients). A checkpoint
holds rank 0's optimiser state.

Between averagings the replicas differ: validation during an epoch (``val_check_interval``)
runs each rank's own replica, and a checkpoint saved then holds rank 0's. Every rank must
make the same number of optimiser steps (Lightning's ``DistributedSampler`` gives equal
shards), since each averaging is a collective.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par import _compat
from lightning_par.collectives import ALGORITHMS, get_allreduce
from lightning_par.collectives.averaging import average_parameters, broadcast_parameters
from lightning_par.strategies._base import ParStrategy


def check_period(period: Any) -> int | None:
    """``period`` if it is a positive int or ``None``; otherwise a clear error."""
    if period is None:
        return None
    if isinstance(period, bool) or not isinstance(period, int):
        raise TypeError(
            f"period must be a whole number of optimiser steps or None (once per epoch), "
            f"got {period!r}"
        )
    if period < 1:
        raise ValueError(
            f"period must be >= 1 optimiser step (1: average after every step, like "
            f"synchronous SGD) or None (once per epoch), got {period}"
        )
    return period


class LocalSGDStrategy(ParStrategy):
    """Local SGD: independent optimiser steps, parameters averaged every ``period`` steps.

    Args:
        period: optimiser steps between averagings (``H``), or ``None`` to average once
            per epoch (after its last step). The end of ``fit`` always averages.
        algorithm: the allreduce that sums the parameters, a key of
            :data:`lightning_par.collectives.ALGORITHMS` (default ``"ring"``).
        average_buffers: also average floating buffers (BatchNorm running statistics).
        **kwargs: ``trace``, ``trace_dir``, ``start_method``, ``process_group_backend``,
            ``timeout`` (see :class:`~lightning_par.strategies._base.ParStrategy`) and the
            arguments Lightning passes. With ``trace`` every averaging is an
            ``average`` span in the trace.
    """

    strategy_name = "local_sgd"

    def __init__(
        self,
        period: int | None = 4,
        algorithm: str = "ring",
        average_buffers: bool = True,
        **kwargs: Any,
    ) -> None:
        self.period = check_period(period)
        get_allreduce(algorithm)  # unknown names fail here, before any process starts
        super().__init__(**kwargs)
        self._algorithm_name = algorithm
        self._allreduce = ALGORITHMS[algorithm]
        self._average_buffers = bool(average_buffers)
        #: Optimiser steps since the last averaging, and averagings done in this run.
        self.steps_since_average = 0
        self.averagings = 0

    @property
    def algorithm_name(self) -> str:
        return self._algorithm_name

    # ---- model states -------------------------------------------------------------------------
    def sync_model_states(self) -> None:
        assert self.model is not None and self.comm is not None
        if self.world_size > 1:  # one replica: nothing to agree on
            broadcast_parameters(self.model, self.comm, root=0)

    def configure_sync(self) -> None:
        self.steps_since_average = 0
        self.averagings = 0

    def average(self) -> None:
        """Average the replicas now (every rank must call it)."""
        assert self.model is not None and self.comm is not None
        if self.world_size > 1:  # one replica is its own average: no communication
            span = self.trace.span("average") if self.trace is not None else nullcontext()
            with span:
                average_parameters(
                    self.model, self._allreduce, self.comm, buffers=self._average_buffers
                )
        self.steps_since_average = 0
        self.averagings += 1

    # ---- no gradient synchronisation ------------------------------------------------------------
    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        pass

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        pass  # local gradients, local step: that is the point

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        yield  # nothing to block: backward never communicates

    # ---- averaging after optimiser steps --------------------------------------------------------
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.steps_since_average += 1
        if self.period is not None:
            due = self.steps_since_average >= self.period
        else:
            due = self._last_batch_of_epoch()
        if due:
            self.average()
        return output

    def _last_batch_of_epoch(self) -> bool:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training:
            return False
        # The loop's own test (epoch length, limit_train_batches, or the data running out):
        # Lightning also uses it to step on the final batch under gradient accumulation.
        return _compat.num_ready_batches_reached(trainer)

    @override
    def on_train_end(self) -> None:
        # Every rank made the same number of steps, so all agree whether one is pending.
        if self.steps_since_average > 0:
            self.average()
        super().on_train_end()
