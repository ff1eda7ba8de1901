"""Asynchronous SGD on sharded parameter servers, as a Lightning strategy (``async_sgd``).

The servers and the update rule are in :mod:`lightning_par.paramserver.asynchronous`; the
processes, checkpoints and refusals are those of ``parameter_server``, in their shared base
:class:`~lightning_par.strategies._server_group.ServerGroupStrategy` (which hands them to a
:class:`~lightning_par.components.server_group.ServerGroup`). What changes, in the hooks
below:

* each worker pushes its whole gradient after backward and the servers apply it at once
  with the user's optimiser; the worker takes back the newest weights and goes on;
* ``staleness=s`` bounds how far a worker may run ahead of the slowest (stale synchronous
  parallel, Ho et al. 2013); ``0`` trains the synchronous parameter server's weights
  (through the asynchronous servers, one push per step), ``None`` is fully asynchronous;
* **no collective among the workers during an epoch**: Lightning broadcasts a SIGTERM flag
  from rank 0 before every training batch, which would keep the workers in lock-step; here
  each worker checks only its own flag. While fitting, Lightning's other collectives
  (the barrier after a checkpoint, ``sync_dist`` reductions, torchmetrics' gather at
  ``compute``, checkpoint decisions) are local to each worker: the workers reach an epoch's
  end up to a batch apart, and one may be gone. ``trainer.test``/``validate`` reduce as usual;
* **work is shared** (``share_work``, on unless ``staleness=0``): server 0 hands out each
  epoch's batches on demand (:mod:`lightning_par.paramserver.work`), so a fast worker takes
  more of them and a straggler holds no epoch back;
* every applied update's staleness (server updates since that worker's last pull) is
  logged as ``staleness`` (``on_step`` and the epoch mean, this worker's own) and, with
  ``trace=True``, recorded in the trace: :func:`staleness_histogram`;
* **remedies for stale updates** (:mod:`lightning_par.paramserver.remedies`), applied by
  the servers to each push: ``staleness_lr`` (Zhang et al. 2016: ``eta / tau``),
  ``dc_lambda`` / ``dc_mean_square`` (DC-ASGD, Zheng et al. 2017) and ``momentum`` (lower
  momentum under asynchrony, Mitliagkas et al. 2016);
* checkpoints take the servers' newest weights (:meth:`AsyncParameterClient.refresh`), and
  at the end every worker receives the servers' final weights once all have stopped.

Each worker's gradient is applied as a full optimiser step, so per update the learning rate
acts on one worker's batch (the synchronous server applies the mean of ``W``); with
``gradient_clip_val`` that worker's gradient is clipped (by its own norm, or by value)
before its push, as one process would clip it on that batch (``staleness=0``: the mean,
clipped on the servers).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_par import _compat
from lightning_par.components.server_group import ServerGroup
from lightning_par.components.worker_group import gloo_only
from lightning_par.paramserver.async_client import (
    ONE_BUCKET_MB,
    AsyncParameterClient,
    staleness_histogram,
)
from lightning_par.paramserver.asynchronous import check_staleness
from lightning_par.paramserver.clipping import GradClip
from lightning_par.paramserver.protocol import NONE
from lightning_par.paramserver.remedies import (
    AUTO_MOMENTUM,
    check_momentum,
    choose_remedies,
    for_workers,
)
from lightning_par.paramserver.work import SharedBatchSampler
from lightning_par.strategies._async_apart import keep_metrics_local, workers_apart
from lightning_par.strategies._async_loader import (
    count_shared_batches,
    hold_final_lr,
    shared_loader,
)
from lightning_par.strategies._async_progress import show_own_progress
from lightning_par.strategies._late_params import refuse_late_parameters
from lightning_par.strategies._ps_features import trainer_clip
from lightning_par.strategies._server_group import ServerGroupStrategy


class AsyncSGDStrategy(ServerGroupStrategy):
    """Asynchronous (or stale synchronous) SGD through ``num_servers`` parameter servers.

    Args:
        num_servers: server processes; parameters are spread over them by bytes.
        staleness: ``None`` (never wait), or ``s >= 0``: a worker more than ``s`` steps
            ahead of the slowest waits for its weights (``0``: synchronous).
        split_mb: tensors larger than this (MiB) are split over all servers.
        share_work: the workers share each epoch's batches, handed out by server 0 on
            demand (:mod:`lightning_par.paramserver.work`); needs Lightning's distributed
            sampler (``use_distributed_sampler=True``, the default), whose loader reads the
            whole dataset. ``None``: on unless ``staleness=0``.
        staleness_lr: apply an update ``tau`` steps stale at ``lr / max(1, tau)``.
        dc_lambda: DC-ASGD's delay compensation ``g + dc_lambda * g * g * (w - w_read)``
            (0: off); ``dc_mean_square=m``: its adaptive form, ``dc_lambda / sqrt(MS)``.
        momentum: the most momentum the servers run the optimiser with (a lower one of
            the model's stays). ``"auto"`` (default): 0.5 where the optimiser has a
            momentum (SGD's 0.9 became 0.5: the best remedy measured by ``python -m
            lightning_par.bench async``, see ``benchmarks/async.md``), nothing otherwise,
            with one worker or with ``staleness=0``; ``None``: the model's own.
        **kwargs: ``trace``, ``trace_dir``, ``start_method``, ``timeout``. With ``trace``
            each applied update is an event ``staleness`` whose ``micro_batch`` field holds
            the staleness (read it with :func:`staleness_histogram`).
    """

    strategy_name = "async_sgd"
    #: a fork launch goes on when a worker other than rank 0 dies (the servers drop it)
    survives_lost_workers = True

    def __init__(
        self,
        num_servers: int = 1,
        staleness: int | None = None,
        split_mb: float = 1.0,
        share_work: bool | None = None,
        staleness_lr: bool = False,
        dc_lambda: float = 0.0,
        dc_mean_square: float | None = None,
        momentum: float | str | None = "auto",
        **kwargs: Any,
    ) -> None:
        self.staleness = check_staleness(staleness)
        self.remedies = choose_remedies(
            self.staleness, staleness_lr, dc_lambda, dc_mean_square, momentum
        )
        if share_work is not None and not isinstance(share_work, bool):
            raise TypeError(f"share_work must be True, False or None, got {share_work!r}")
        # staleness=0 is the synchronous server, with its fixed shards, by default
        self.share_work = share_work if share_work is not None else self.staleness != 0
        self.sampler: SharedBatchSampler | None = None
        self._taken: deque[tuple[int, int]] = deque()
        #: each metric's own ``distributed_available_fn``, while fitting keeps it local
        self._metrics_available: dict[int, Callable[[], bool]] = {}
        if "bucket_cap_mb" in kwargs:
            raise TypeError(
                "async_sgd pushes the whole gradient in one message after backward; "
                "bucket_cap_mb does not apply"
            )
        gloo_only(kwargs)
        self.servers = ServerGroup(num_servers, ONE_BUCKET_MB, split_mb, AsyncParameterClient)
        super().__init__(process_group_backend="gloo", **kwargs)
        self.num_servers, self.bucket_cap_mb, self.split_mb = num_servers, ONE_BUCKET_MB, split_mb
        self._logged = 0

    @property
    def client(self) -> AsyncParameterClient | None:
        """This worker's client of the servers (after ``setup`` while fitting)."""
        client = self.servers.client
        return client if isinstance(client, AsyncParameterClient) else None

    # ---- processes ----------------------------------------------------------------------------
    @override
    def setup_distributed(self) -> None:
        self.set_world_ranks()  # (no reset_seed(): see ParStrategy.setup_distributed)
        self.start_servers(self._server_options())  # asynchronous, and the remedies

    @override
    def watched_ranks(self) -> list[int]:
        """Worker 0 and the servers: the others may be lost and the job goes on."""
        return [0, *range(self.world_size, self.world_size + self.num_servers)]

    def _server_options(self) -> dict[str, Any]:
        remedies = for_workers(self.remedies, self.world_size)
        return {"asynchronous": True, "staleness": self.staleness, "remedies": remedies}

    def _client_options(self, clip: GradClip | None) -> dict[str, Any]:
        """``staleness=0`` applies the mean of every worker's gradient, clipped on the servers
        as the synchronous server does; otherwise each push is one worker's gradient, which
        that worker clips before pushing (one process on that batch would do the same)."""
        return {"clip": clip} if self.staleness == 0 else {"local_clip": clip}

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            count_shared_batches(
                trainer, lambda: self.sampler, lambda: self.client is not None, self.world_size
            )
        self.check_before_launch(trainer)  # also under torchrun, where no launcher calls it
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self.connect_servers(self._client_options(trainer_clip(trainer)))
            _compat.replace_sigterm_broadcast(trainer, self._own_sigterm)
            if self.share_work:
                show_own_progress(trainer)  # this worker's batches, no false total
            for config in trainer.lr_scheduler_configs if self.share_work else []:
                hold_final_lr(config.scheduler)  # a worker may take a few more than its share
        fitting = trainer.state.fn == TrainerFn.FITTING
        assert self.model is not None
        keep_metrics_local(self.model, self._metrics_available, local=fitting)
        self._logged = 0

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """The momentum remedy needs an optimiser that has one: checked here, before the
        servers learn the optimiser (:func:`~lightning_par.paramserver.remedies.check_momentum`)."""
        super().setup_optimizers(trainer)
        remedies = for_workers(self.remedies, self.world_size)
        note = check_momentum(remedies, self.optimizers)
        if note is not None:
            rank_zero_info(note)

    def _own_sigterm(self) -> None:
        """No broadcast: a worker stops on its own signal only."""
        if getattr(self.lightning_module.trainer, "received_sigterm", False):
            raise SIGTERMException()

    @property
    def updates(self) -> list[tuple[int, int, int]]:
        """``(step, staleness, lead)`` of this worker's applied updates so far."""
        return list(self.client.updates) if self.client is not None else []

    # ---- dynamic work sharing ---------------------------------------------------------------
    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        shared = None
        if self.share_work and trainer.state.stage == RunningStage.TRAINING:
            shared = shared_loader(dataloader, self._next_batch)
        if shared is None:
            return super().process_dataloader(dataloader)
        loader, self.sampler = shared
        self._taken.clear()
        return loader

    def _next_batch(self, epoch: int, num_batches: int) -> tuple[int, int]:
        if self.client is None:
            return epoch, NONE  # iterated before the servers are up (see above)
        epoch = self.lightning_module.trainer.current_epoch  # whether or not set_epoch was called
        item = self.client.next_batch(epoch, num_batches)
        if item[1] != NONE:
            self._taken.append(item)
        return item

    # ---- no lock-step at epoch ends ----------------------------------------------------------
    def _apart(self) -> bool:
        """While fitting, the workers are not in step (:func:`._async_apart.workers_apart`)."""
        return workers_apart(self.lightning_module)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not self._apart():  # after a checkpoint only worker 0 writes: no one need wait
            self.servers.workers.barrier()

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """While fitting, this worker's own value (``sync_dist=True`` logs it unreduced)."""
        if self._apart():
            return tensor
        return super().reduce(tensor, group=group or self.worker_group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision if self._apart() else super().reduce_boolean_decision(decision, all)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.client is not None:  # before this step pushes or pulls anything
            refuse_late_parameters(self.lightning_module, self.client.params, self.strategy_name)
            if self._taken:
                self.client.trained = self._taken.popleft()  # batches train in the order taken
        output = super().training_step(*args, **kwargs)
        updates = self.updates  # the forward above took back the last step's answer
        if len(updates) > self._logged:
            new = updates[self._logged :]
            self._logged = len(updates)
            self.lightning_module.log(
                "staleness", float(new[-1][1]), on_step=True, on_epoch=True,
                sync_dist=True, batch_size=1,  # local while fitting (reduce): no warning
            )  # fmt: skip
        return output

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.client is not None:
            self.client.refresh()  # the servers' newest weights, not this worker's last pull
        return super().lightning_module_state_dict()


__all__ = ["AUTO_MOMENTUM", "AsyncSGDStrategy", "check_staleness", "staleness_histogram"]
