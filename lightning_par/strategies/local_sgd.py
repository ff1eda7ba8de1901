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

**fault_tolerant=True** keeps every replica past a lost rank (rank 0 too: the first
survivor takes over its share; under ``popen`` the script's process keeps rank 0): at each
averaging each rank keeps the mean and receives its left neighbour's optimiser state; the
next averaging finds the loss (or a metric synced with ``sync_dist=True``, or a barrier,
which then run again over the survivors; Lightning's per-step SIGTERM broadcast, whose
failure no rank would see alike, is replaced by each rank's own flag), the survivors
re-form the group (:mod:`~lightning_par.components.fault_tolerance`), the lost rank's right
neighbour rebuilds its replica, replays its steps since the last averaging and trains it
every step after, and the averaging is run again over every replica of the first world:
the run ends with the weights it would have had without the fault, to float rounding
(:mod:`~lightning_par.components.replica_ring`, :mod:`._local_replicas`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par import _compat
from lightning_par.collectives import ALGORITHMS, get_allreduce
from lightning_par.collectives.averaging import average_parameters, broadcast_parameters
from lightning_par.comm import Communicator
from lightning_par.strategies._base import ParStrategy
from lightning_par.strategies._local_replicas import LocalReplicas
from lightning_par.strategies._resilience import Resilience

#: What the survivors do after a loss, in the line that names it.
RECOVERY = "each lost replica is rebuilt by the next rank and the averaging is run again"


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
        fault_tolerant: go on without a rank that is lost (killed, frozen past
            ``dead_peer_timeout``): its replica is rebuilt from its neighbour's copy and
            trained by that neighbour, so the weights stay those of the run without the
            fault (module docstring). Each averaging then also sends each rank's optimiser
            state to its neighbour.
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
        fault_tolerant: bool = False,
        **kwargs: Any,
    ) -> None:
        self.period = check_period(period)
        get_allreduce(algorithm)  # unknown names fail here, before any process starts
        super().__init__(**kwargs)
        self._algorithm_name = algorithm
        self._allreduce = ALGORITHMS[algorithm]
        self._average_buffers = bool(average_buffers)
        self.resilience = Resilience(self, fault_tolerant, RECOVERY)
        self.replicas = LocalReplicas(self, self.resilience, self._allreduce, self._average_buffers)
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
        self.replicas.begin_fit()

    def average(self) -> None:
        """Average the replicas now (every rank must call it); ``fault_tolerant``: again
        over the survivors, every replica in it, when a rank is lost meanwhile."""
        assert self.model is not None and self.comm is not None
        if self.world_size > 1:  # one replica is its own average: no communication
            span = self.trace.span("average") if self.trace is not None else nullcontext()
            with span:
                if self.resilience.enabled:
                    self.resilience.retrying(self.replicas.average, self.regrouped)()
                else:
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
        self.replicas.after_step()
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

    # ---- fault tolerance (a no-op without ``fault_tolerant``) ---------------------------------
    @property
    @override
    def is_global_zero(self) -> bool:
        """Rank 0, or the first survivor once rank 0 was lost (``fault_tolerant``)."""
        return self.resilience.leads()

    @property
    def survives_lost_rank_zero(self) -> bool:
        """Rank 0's loss too (the job's store outlives it: under ``popen`` the script's
        process keeps it and rank 0)."""
        return self.resilience.enabled

    @property
    def survives_lost_workers(self) -> bool:
        """The launcher goes on when a rank other than 0 is lost (``fault_tolerant``)."""
        return self.resilience.enabled

    @override
    def check_before_launch(self, trainer: Any) -> None:
        super().check_before_launch(trainer)
        self.resilience.check_before_launch(trainer)
        self.replicas.check_before_launch()

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        self.resilience.start()

    @override
    def teardown(self) -> None:
        self.resilience.teardown()
        super().teardown()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        self.resilience.setup(trainer)
        self.replicas.check_before_launch()
        if self.resilience.enabled and trainer.state.fn == TrainerFn.FITTING:
            # Lightning broadcasts a SIGTERM flag from rank 0 before every step and ignores
            # its failure: after a loss the survivors' collectives would fall out of step
            # (one that got the flag goes on, one that did not waits on rank 0). Without
            # it the ranks meet only in the averagings and in Lightning's reduce and
            # barrier, none of which completes anywhere without every member: every
            # survivor finds a loss in the same one.
            _compat.replace_sigterm_broadcast(trainer, self._own_sigterm)

    def _own_sigterm(self) -> None:
        """No broadcast: each rank stops on its own signal (fault_tolerant)."""
        if getattr(self.lightning_module.trainer, "received_sigterm", False):
            raise SIGTERMException()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self.resilience.sampler_kwargs(super().distributed_sampler_kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.replicas.before_step(args[1] if len(args) > 1 else kwargs.get("batch_idx", 0))
        return super().training_step(*args, **kwargs)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """``fault_tolerant``: a metric synced (``sync_dist=True``) when a rank is lost is
        synced again over the survivors (its replica is stood in for after this step)."""
        if not self.resilience.enabled or group is not None or not torch.is_tensor(tensor):
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        base = super()  # (every rank fails alike: none completes without every member)
        return self.resilience.retrying(
            lambda: base.reduce(tensor.clone(), reduce_op=reduce_op), self.regrouped
        )()

    @override
    def barrier(self, name: str | None = None) -> None:
        if not self.resilience.enabled:
            return super().barrier(name)
        base = super()
        self.resilience.retrying(lambda: base.barrier(name), self.regrouped)()

    def regrouped(self) -> None:
        """The survivors met in a new default group: average over it, and stand in for the
        lost ranks' replicas."""
        self.comm = Communicator(trace=self.trace)
        self.resilience.regrouped(self.lightning_module.trainer)
        self.replicas.regrouped()
