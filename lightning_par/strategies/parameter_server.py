"""Synchronous sharded parameter server as a Lightning strategy.

Workers are Lightning's training processes (``devices`` x ``num_nodes``); ``num_servers``
extra processes, started by the workers (:mod:`lightning_par.paramserver.process`), hold the
parameters and the optimiser state and apply the updates (course material 003: "store the
model parameters outside of the workers"). The algorithm is in :mod:`lightning_par.paramserver`;
this file plugs it into Lightning. The hooks it shares with ``async_sgd`` (Lightning's
collectives among the workers, the step through the servers, checkpoints from the servers,
the goodbye) are in its base,
:class:`~lightning_par.strategies._server_group.ServerGroupStrategy`, which hands them to a
:class:`~lightning_par.components.server_group.ServerGroup`; the hooks below are its own:

* ``setup_distributed``: each node's local rank 0 starts its share of the servers
  (:mod:`lightning_par.paramserver.process`), then all ``W + S`` ranks join one gloo
  process group; Lightning's ``barrier``/``broadcast``/``reduce``/``all_gather`` use a
  group of the workers only (:mod:`~lightning_par.components.worker_group`). Under
  popen, torchrun or SLURM nothing changes: launch ``W`` workers as usual. ``teardown``
  ends the servers and the group, so ``fit`` then ``test`` starts fresh ones.
* ``setup``: a :class:`~lightning_par.paramserver.ParameterClient` over the model and the
  user's optimiser (its class and param groups run on the servers);
* the step: backward pushes each gradient bucket as it is filled, ``optimizer_step`` runs
  the closure and the ``on_before_optimizer_step`` hooks but not ``optimizer.step``: the
  servers step; the next forward waits per layer for the pulled weights;
* checkpoints: the full model (every worker has it) and the full optimiser state gathered
  from the servers, in the format of the user's optimiser, so they load without this
  strategy; resuming sends the state back to the servers.

With ``fault_tolerant=True`` each server's shard (its slices of the weights and their
optimiser state) is copied in the next server process after every update (a standby process
for a lone server), and a server that dies is taken over by that copy: the job goes on and
its weights equal those of a run without the loss
(:mod:`lightning_par.paramserver.replication`, :mod:`~lightning_par.paramserver.takeover`).
A lost worker is survived too: the first live worker (worker 0, or the first survivor once
worker 0 is lost) pushes its gradient of the step it was lost in, then trains its batches
beside its own, pushing that gradient in the lost worker's slot, so the weights stay those
of one process on the whole batch, bit for bit those of the run without the loss
(:mod:`lightning_par.paramserver.lost_workers`, :mod:`._ps_stand_in`). Worker 0's loss is
survived where the job's store outlives it (a fork launch, ``popen`` behind the script's
keeper, torchrun, srun): its servers outlive it, and the first survivor takes over its
loggers and checkpoints (:mod:`._leader`).

Gradient clipping (by norm: the servers exchange their shards' squared norms) and
``bf16-mixed`` are exact against one process (:mod:`~lightning_par.strategies._ps_features`).
Refused before training: manual optimisation, several optimisers, ``16-mixed`` and true
half precision, a ``configure_gradient_clipping`` override, ``sync_batchnorm``, optimisers
that are not element-wise.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_par import _compat
from lightning_par.components.server_group import ServerGroup
from lightning_par.components.worker_group import gloo_only
from lightning_par.paramserver.replicated_client import ReplicatedClient
from lightning_par.paramserver.worker import ParameterClient
from lightning_par.strategies._base import ParStrategy
from lightning_par.strategies._late_params import refuse_late_parameters
from lightning_par.strategies._leader import lead_again, share_versions
from lightning_par.strategies._ps_features import trainer_clip
from lightning_par.strategies._ps_stand_in import LostWorkerStandIn, SettleBeforeMetrics
from lightning_par.strategies._resilience import Resilience
from lightning_par.strategies._server_group import ServerGroupStrategy


class ParameterServerStrategy(ServerGroupStrategy):
    """Data parallelism through ``num_servers`` sharded, synchronous parameter servers.

    Args:
        num_servers: server processes ``S``; parameters are spread over them by bytes.
        bucket_cap_mb: gradient bucket (push) size in MiB; small buckets push layer by layer.
        split_mb: tensors larger than this (MiB) are split over all servers.
        fault_tolerant: copy each server's shard in the next server process (one server: in
            a standby process), so that the job goes on, exactly, when a server dies; and go
            on without a lost worker, whose batches the first live worker then trains
            (worker 0 too: the first survivor takes over its share).
        **kwargs: ``trace``, ``trace_dir``, ``start_method``, ``timeout`` (see
            :class:`~lightning_par.strategies._base.ParStrategy`). The process group is
            always gloo (servers run on CPU; CUDA tensors are staged through pinned memory).
    """

    strategy_name = "parameter_server"

    def __init__(
        self,
        num_servers: int = 1,
        bucket_cap_mb: float = 1.0,
        split_mb: float = 1.0,
        fault_tolerant: bool = False,
        **kwargs: Any,
    ) -> None:
        gloo_only(kwargs)
        self.resilience = Resilience(self, fault_tolerant)  # (refusals: check_before_launch)
        self.stand_in = LostWorkerStandIn(self, partial(ParStrategy.training_step, self))
        client = ReplicatedClient if fault_tolerant else ParameterClient
        self.servers = ServerGroup(num_servers, bucket_cap_mb, split_mb, client, fault_tolerant)
        super().__init__(process_group_backend="gloo", **kwargs)
        self.num_servers, self.bucket_cap_mb, self.split_mb = num_servers, bucket_cap_mb, split_mb
        self.fault_tolerant = fault_tolerant

    @property
    def client(self) -> ParameterClient | None:
        """This worker's client of the servers (after ``setup`` while fitting)."""
        return self.servers.client

    # ---- processes -----------------------------------------------------------------------------
    @override
    def setup_distributed(self) -> None:
        self.set_world_ranks()  # (no reset_seed(): see ParStrategy.setup_distributed)
        if self.servers.lost:  # a call after a loss: Lightning's rank 0 is the first survivor
            lead_again(self.servers.members(self.world_size).index(self.global_rank))
        self.start_servers({})  # the synchronous servers: no options

    @property
    def survives_lost_workers(self) -> bool:
        """The launcher goes on when a worker is lost (``fault_tolerant``)."""
        return self.fault_tolerant

    @property
    def survives_lost_rank_zero(self) -> bool:
        """Worker 0's loss too, where the job's store outlives it (under ``popen``: behind
        the script's keeper): the servers outlive it and the first survivor takes over."""
        return self.fault_tolerant

    @property
    @override
    def is_global_zero(self) -> bool:
        """Worker 0, or the first survivor once worker 0 was lost (``fault_tolerant``)."""
        members = self.servers.members(self.world_size)
        return bool(members) and self.global_rank == members[0]

    @override
    def watched_ranks(self) -> list[int]:
        """Every worker and server (and a lone server's standby): the step waits for all."""
        workers = len(self.servers.members(self.world_size))
        return list(range(workers + self.servers.num_processes))

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self.check_before_launch(trainer)  # also under torchrun, where no launcher calls it
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        self.servers.watch_sigterm(trainer)
        self.connect_servers({"clip": trainer_clip(trainer)})  # the servers clip the mean
        if self.fault_tolerant:  # before each batch: a lost worker's push, the survivors' group
            share_versions(trainer)  # (a survivor may take over worker 0's loggers)
            self.stand_in.connect()
            _compat.replace_sigterm_broadcast(trainer, partial(self._before_batch, trainer))
            # (first: the user's epoch-end hooks may sync too; once, however many fits)
            trainer.callbacks[:] = [
                SettleBeforeMetrics(self.stand_in),
                *(c for c in trainer.callbacks if not isinstance(c, SettleBeforeMetrics)),
            ]

    def _before_batch(self, trainer: pl.Trainer) -> None:
        self.stand_in.before_batch(trainer)
        self.servers.workers.broadcast_sigterm(trainer, self.global_rank)

    # ---- Lightning's collectives: among the workers (broadcast, all_gather: the base) --------
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self.servers.workers.barrier()

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        return super().reduce(tensor, group=group or self.worker_group, reduce_op=reduce_op)

    # ---- the step (backward and optimizer_step: the base) ------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        client = self.client
        if client is not None:  # before this step pushes or pulls anything
            refuse_late_parameters(self.lightning_module, client.params, self.strategy_name)
        if not self.fault_tolerant or client is None:
            return super().training_step(*args, **kwargs)
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        self.stand_in.record(client.step, self.lightning_module.trainer.current_epoch, batch_idx)
        output = super().training_step(*args, **kwargs)
        return self.stand_in.train_lost_batches(output, batch_idx)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self.stand_in.sampler_kwargs(super().distributed_sampler_kwargs)

    # ---- checkpoints (the optimiser state: the base) -----------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.servers.settle()
        return super().lightning_module_state_dict()
