"""``ParameterServerStrategy(fault_tolerant=True)``: the batches of a lost worker, trained by
the leader (worker 0, or the first survivor once worker 0 is lost) so that the weights stay
those of one process on the whole batch.

The servers' side and the protocol are :mod:`lightning_par.paramserver.lost_workers`; what
the strategy adds, through :class:`LostWorkerStandIn`:

* the gradient of the step a worker was lost in, computed on that worker's batch (its shard
  of Lightning's ``DistributedSampler`` read again, :class:`~._stand_ins.LostShards`) with
  the weights the step began with, which the leader pushes in its place
  (:meth:`LostWorkerStandIn.gradients`, the client's ``fill``);
* from the next step on, the leader trains the lost workers' batches beside its own: each
  one's gradient computed apart (:meth:`LostWorkerStandIn.train_lost_batches`) and pushed in
  that worker's slot, so the servers sum every slot in worker order as without the loss
  (the sum of the losses, one push, would round otherwise from three workers on); the
  servers still divide by the first number of workers, so nothing is rescaled;
* Lightning's collectives among the workers (the per-step SIGTERM flag, ``sync_dist``,
  barriers) run over a group of the survivors, met once the loss is known (before the
  step's row is logged and before the epoch's metrics are synced,
  :class:`SettleBeforeMetrics`), and a loader built after it (a validation) shards its data
  over them;
* worker 0 lost: the first survivor stands in for it (the servers and the client take it
  for the leader, :attr:`~lightning_par.paramserver.missing_pushes.MissingPushes.leader`)
  and takes over its loggers and checkpoints (:func:`~._leader.take_over`).

The allreduce strategies do the same with :mod:`lightning_par.components.fault_tolerance`,
which re-forms their one process group; here the group of workers and servers stays (gloo
fails only the lost worker's connections), so only the workers' group is made again.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_par import _compat
from lightning_par.paramserver.replicated_client import ReplicatedClient
from lightning_par.strategies._leader import take_over
from lightning_par.strategies._stand_ins import (
    LostShards,
    in_modes,
    loss_of,
    stand_in_outputs,
)

Step = Callable[..., Any]


class LostWorkerStandIn:
    """The leader in the place of lost workers (see the module docstring); ``strategy``: a
    ``ParameterServerStrategy``, ``step``: its ``training_step`` below the one recording
    the batches (the user's step in Lightning's precision context)."""

    def __init__(self, strategy: Any, step: Step) -> None:
        self._strategy, self._step = strategy, step
        self._shards = LostShards()
        # client step -> (epoch, batch_idx, each module's training flag)
        self._batches: dict[int, tuple[int, int, list[bool]]] = {}
        self._grouped_for: list[int] = []  # the lost workers the validation loader knows
        #: when (wall time) this fit's first loss was found (``lost``, on the leader: its push
        #: sent in the lost worker's place) and the survivors met in their group (``regrouped``)
        self.events: list[tuple[str, float]] = []

    @property
    def _client(self) -> ReplicatedClient | None:
        client = self._strategy.client
        return client if isinstance(client, ReplicatedClient) else None

    @property
    def lost(self) -> list[int]:
        """This call's workers lost so far (their ranks in it)."""
        client = self._client
        return list(client.lost_workers) if client is not None else list(self._grouped_for)

    def connect(self) -> None:
        """A ``fit``'s client is connected: the leader computes the lost workers' gradients."""
        self._shards, self._batches, self._grouped_for = LostShards(), {}, []
        self.events = []
        if self._client is not None:
            self._client.missing.fill = self.gradients

    # ---- the step ------------------------------------------------------------------------
    def before_batch(self, trainer: Any) -> None:
        """Before each batch (the SIGTERM flag's place): the last step's weights are in (a
        lost worker's push sent in its place), and the workers' group holds the survivors."""
        self._strategy.servers.settle()  # (which meets the survivors in a workers' group)
        lost = self.lost
        if lost != self._grouped_for:  # the next validation reads its data over the survivors
            self._grouped_for = lost
            self.events.append(("regrouped", time.time()))
            _compat.reset_combined_loader(trainer.fit_loop.epoch_loop.val_loop)
            # (worker 0 lost: the first survivor takes over its loggers and checkpoints)
            strategy = self._strategy
            take_over(trainer, strategy.servers.members(strategy.world_size).index(
                strategy.global_rank))  # fmt: skip

    def record(self, step: int, epoch: int, batch_idx: int) -> None:
        """The batch client step ``step`` trains (a lost worker's is read again from it),
        and the modules' modes it trains in (its gradient may be computed in a validation)."""
        modes = [m.training for m in self._strategy.lightning_module.modules()]
        self._batches[step] = (epoch, batch_idx, modes)
        self._batches.pop(step - 2, None)

    def gradients(self, step: int, workers: list[int]) -> dict[int, list[torch.Tensor | None]]:
        """Each of ``workers``' gradient of client step ``step`` on its own batch, with the
        weights as they are (the step's: none of its pulls is written yet) and the modules
        in the step's modes (a validation may run now: BatchNorm, dropout in eval mode)."""
        if not self.events:
            self.events.append(("lost", time.time()))
        epoch, batch_idx, modes = self._batches[step]
        loader = self._strategy.lightning_module.trainer.train_dataloader
        batches = self._shards.batches(loader, workers, batch_idx, epoch)
        module = self._strategy.lightning_module
        # (also inside a validation: out of its inference mode and its eval mode)
        with torch.inference_mode(False), torch.enable_grad(), in_modes(module, modes):
            grads = self._gradients_of(workers, batches, batch_idx)
        names = ", ".join(f"worker {w} (rank {w})" for w in workers)
        leader = self._client.missing.leader if self._client is not None else 0
        print(
            f"lightning_par: {names} lost; worker {leader} pushed its gradient of step {step} "
            "in its place and trains its batches from now on (the weights stay one process's)",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        return grads

    def train_lost_batches(self, output: Any, batch_idx: int) -> Any:
        """The leader, in the training step: each lost worker's gradient on its batch of this
        step, handed to the client, which pushes it in that worker's slot after its own
        push of each bucket; ``output`` is returned as it is (its backward: the leader's own)."""
        lost, client = self.lost, self._client
        if not lost or client is None or client.rank != client.missing.leader:
            return output
        loader = self._strategy.lightning_module.trainer.train_dataloader
        batches = self._shards.batches(loader, lost, batch_idx)
        client.missing.keep(client.step, self._gradients_of(lost, batches, batch_idx))
        return output

    def _gradients_of(self, workers: list[int], batches: list[Any], batch_idx: int
                      ) -> dict[int, list[torch.Tensor | None]]:  # fmt: skip
        """Each of ``workers``' gradient on its batch of ``batches``, by itself: as that
        worker's own backward computes it, bit for bit."""
        strategy, params = self._strategy, self._client.params if self._client else []
        grads = {}
        for worker, batch in zip(workers, batches):
            (output,) = stand_in_outputs(
                self._step, [strategy.batch_to_device(batch)], batch_idx, strategy.lightning_module
            )
            loss = loss_of(output, f"worker {worker}'s batch")
            grads[worker] = list(torch.autograd.grad(loss, params, allow_unused=True))
        return grads

    def sampler_kwargs(self, first: dict[str, Any]) -> dict[str, Any]:
        """A loader built after a loss (in this call or an earlier one) shards its data
        over the survivors."""
        strategy = self._strategy
        survivors = strategy.servers.members(strategy.world_size)
        if len(survivors) == strategy.world_size:
            return first
        rank = survivors.index(strategy.global_rank)
        return {**first, "num_replicas": len(survivors), "rank": rank}


class SettleBeforeMetrics(pl.Callback):
    """At the end of each training batch and epoch, before Lightning logs the step's row
    and computes (and syncs) the epoch's metrics: the step's lost workers are known, the
    survivors meet in their own group, and the first survivor leads if worker 0 was lost.
    Otherwise the row of the step worker 0 was lost in would be logged by no one, and a
    worker lost in the last step of ``fit`` (no next batch to settle before) would leave
    torchmetrics' gather waiting for it on the old group."""

    def __init__(self, stand_in: LostWorkerStandIn) -> None:
        self.stand_in = stand_in

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:  # fmt: skip
        self.stand_in.before_batch(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.stand_in.before_batch(trainer)
