"""GPipe pipeline parallelism as a Lightning strategy: one process per stage.

The network ``module.<module_attr>`` (an ``nn.Sequential``) is cut into ``K = devices``
stages; each process keeps one stage and the batch is fed through as ``chunks``
micro-batches (Huang et al., 2019). The algorithm lives in :mod:`lightning_par.pipeline`;
this file only plugs it into Lightning's hooks.

Contract with the LightningModule (the models in :mod:`lightning_par.models` satisfy it):

* ``module.net`` (``module_attr``) is an ``nn.Sequential`` whose elements each map one
  tensor to one tensor, with no batch-coupled layers (BatchNorm statistics would be per
  micro-batch; use GroupNorm);
* the loss depends on the parameters only through ``self.net(x)``, called once per step
  with the whole batch; everything after it (loss, metrics, logging) runs unchanged on
  every rank with the real output, which the last stage sends to all stages;
* for ``schedule="1f1b"`` the batch is ``(x, y, ...)`` and ``module.criterion``
  (``loss_attr``) is a mean-reduced loss of ``(output, y)``: 1F1B needs the loss per
  micro-batch, and a mean loss is the size-weighted sum of micro-batch losses.

All stages read the same batches (no distributed sampler). Checkpoints hold the full model
gathered on rank 0 and load without this strategy (``CifarCNN.load_from_checkpoint``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_par.comm import Communicator
from lightning_par.pipeline.partition import split_sequential
from lightning_par.pipeline.sequential import PipelinedSequential
from lightning_par.pipeline.state import (
    gather_full_state_dict,
    gather_optimizer_state,
    send_weights_from_first,
    stage_optimizer_state,
)
from lightning_par.strategies import _gpipe_checks as checks
from lightning_par.strategies._base import ParStrategy


class GPipeStrategy(ParStrategy):
    """Pipeline parallelism with micro-batches and re-materialisation (GPipe).

    Args:
        balance: layers per stage (``len(balance)`` = number of devices); ``None`` balances
            automatically (``balance_by``).
        chunks: micro-batches per batch, ``M``; ``1`` is the naive layer-per-device split.
        checkpoint: re-materialisation, ``"never"``, ``"except_last"`` or ``"always"``.
        schedule: ``"gpipe"`` (all forwards, then all backwards) or ``"1f1b"``.
        module_attr: name of the ``nn.Sequential`` attribute of the LightningModule.
        loss_attr: name of its mean-reduced loss module (used by ``"1f1b"`` only).
        balance_by: automatic balance by ``"params"`` (parameter count) or ``"time"``
            (forward + backward time per layer on ``module.example_input_array``).
        **kwargs: ``trace``, ``trace_dir`` (per-rank traces for
            :mod:`lightning_par.pipeline.timeline`), ``start_method``,
            ``process_group_backend``, ``timeout``: see
            :class:`~lightning_par.strategies._base.ParStrategy`.
    """

    strategy_name = "gpipe"
    shards_data = False

    def __init__(
        self,
        balance: list[int] | None = None,
        chunks: int = 4,
        checkpoint: str = "except_last",
        schedule: str = "gpipe",
        module_attr: str = "net",
        loss_attr: str = "criterion",
        balance_by: str = "params",
        **kwargs: Any,
    ) -> None:
        checks.check_settings(balance, chunks, checkpoint, schedule, balance_by)
        super().__init__(**kwargs)
        self.balance, self.chunks, self.checkpoint = balance, chunks, checkpoint
        self.schedule, self.module_attr, self.loss_attr = schedule, module_attr, loss_attr
        self.balance_by = balance_by

    # ---- the stages' ranks ------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        """Pipeline stages: one per process (the hybrid strategy: its model-parallel degree)."""
        return self.num_processes * self.num_nodes

    @property
    def stage_comm(self) -> Communicator | None:
        """The stages' communicator, stage = its rank (the hybrid strategy: one model-parallel
        group of its grid); ``None`` before setup."""
        return self.comm

    # ---- splitting the network --------------------------------------------------------------
    def prepare_model(self, trainer: pl.Trainer) -> None:
        checks.check_trainer(trainer, self.schedule, self.precision_plugin)
        checks.check_backend(self.schedule, self._process_group_backend)
        self._split_network()

    @property
    def pipelined(self) -> PipelinedSequential:
        net = getattr(self.lightning_module, self.module_attr, None)
        assert isinstance(net, PipelinedSequential), "the network has not been split yet"
        return net

    def _split_network(self) -> None:
        module = self.lightning_module
        net = getattr(module, self.module_attr, None)
        if isinstance(net, PipelinedSequential):
            return
        self.check_before_launch(self.lightning_module.trainer)
        balance = checks.resolve_balance(
            module, net, stages=self.num_stages, balance=self.balance, balance_by=self.balance_by,
            rank=self.global_rank, broadcast=self.broadcast,
        )  # fmt: skip
        stages = split_sequential(net, balance)
        piped = PipelinedSequential(
            net, balance, self.stage_comm, chunks=self.chunks, checkpoint=self.checkpoint,
            schedule=self.schedule,
        )  # fmt: skip
        piped.to(self.root_device)
        first = [s.state_dict() for s in stages] if self.stage_comm.rank == 0 else None
        send_weights_from_first(self.stage_comm, first, piped.state_dict(), self.root_device)
        setattr(module, self.module_attr, piped)

    def check_before_launch(self, trainer: pl.Trainer | None = None) -> None:
        """Reject a network, balance or loss this strategy cannot run, before any process
        starts (the launcher calls this in the main process)."""
        checks.check_before_launch(
            self.lightning_module, trainer, module_attr=self.module_attr,
            stages=self.num_stages, balance=self.balance,
            balance_by=self.balance_by, schedule=self.schedule, loss_attr=self.loss_attr,
            devices=self.parallel_devices or [], backend=self._process_group_backend,
        )  # fmt: skip

    # ---- steps ------------------------------------------------------------------------------
    def _in_step(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        net = self.pipelined
        net.active = True
        try:
            return getattr(super(), hook)(*args, **kwargs)
        finally:
            net.active = False

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        x = batch if isinstance(batch, torch.Tensor) else batch[0]
        if x.shape[0] < self.chunks:
            if self.lightning_module.trainer.global_step == 0:
                raise ValueError(
                    f"chunks={self.chunks} micro-batches but the batch has {x.shape[0]} samples: "
                    f"use chunks <= batch size"
                )
            rank_zero_warn(f"a batch of {x.shape[0]} < chunks={self.chunks} samples runs as "
                           f"{x.shape[0]} micro-batches")  # fmt: skip
        if self.schedule == "1f1b":
            if isinstance(batch, torch.Tensor) or len(batch) < 2:
                raise TypeError("schedule='1f1b' needs batches of the form (input, target, ...)")
            scale = 1.0 / self.lightning_module.trainer.accumulate_grad_batches
            loss_fn = getattr(self.lightning_module, self.loss_attr)
            with self.precision_plugin.train_step_context():
                self.pipelined.train_1f1b(x, batch[1], loss_fn, scale)
        return self._in_step("training_step", *args, **kwargs)

    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any):
        closure_loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        self.pipelined.backward()  # GPipe's backward half (1F1B already ran its backwards)
        return closure_loss

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._in_step("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._in_step("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._in_step("predict_step", *args, **kwargs)

    # ---- checkpoints: the full model on rank 0 -----------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full model's state dict on rank 0 (every stage's layers, original names)."""
        local = self.lightning_module.state_dict()
        return gather_full_state_dict(
            self.stage_comm, local, f"{self.module_attr}.", self.root_device
        )

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        state = super().optimizer_state(optimizer)
        return gather_optimizer_state(self.stage_comm, state, self.root_device)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(stage_optimizer_state(state, self.stage_comm.rank))
