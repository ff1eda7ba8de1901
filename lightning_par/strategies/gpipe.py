"""GPipe pipeline parallelism as a Lightning strategy: one process per stage.

The network ``module.<module_attr>`` (an ``nn.Sequential``) is cut into ``K = devices``
stages; each process keeps one stage and the batch is fed through as ``chunks``
micro-batches (Huang et al., 2019). The algorithm lives in :mod:`lightning_par.pipeline`;
this file only plugs it into Lightning's hooks.

Contract with the LightningModule (the models in :mod:`lightning_par.models` satisfy it):

* ``module.net`` (``module_attr``) is an ``nn.Sequential`` whose elements each map one
  tensor to one tensor, best with no batch-coupled layers (BatchNorm normalises each
  micro-batch on its own: a warning says so; use GroupNorm);
* the loss depends on the parameters only through ``self.net(x)``, called once per step
  with the whole batch; everything after it (loss, metrics, logging) runs unchanged on
  every rank with the real output, which the last stage sends to all stages;
* for ``schedule="1f1b"`` the batch is ``(x, y, ...)`` and ``module.criterion``
  (``loss_attr``) is a mean-reduced loss of ``(output, y)``: 1F1B needs the loss per
  micro-batch, and a mean loss is the size-weighted sum of micro-batch losses.

All stages read the same batches (no distributed sampler; checked once, on the first
batch). Checkpoints hold the full model gathered on rank 0, which loads without this
strategy (``CifarCNN.load_from_checkpoint``), and the whole model's optimiser state in the
format of the user's optimiser in one process (:mod:`lightning_par.pipeline.optim_state`),
so they resume under any strategy. Clipping by norm, ``16-mixed`` and BatchNorm: see
:mod:`lightning_par.strategies._pipeline_features`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_par.comm import Communicator
from lightning_par.pipeline import options as schedules
from lightning_par.pipeline.batchnorm import commit_batch_norm, defer_batch_norm
from lightning_par.pipeline.optim_state import merge_stage_states, model_order, stage_state
from lightning_par.pipeline.sequential import PipelinedSequential
from lightning_par.pipeline.state import (
    gather_full_state_dict,
    gather_objects,
    send_weights_from_first,
    stage_optimizer_state,
)
from lightning_par.strategies import _gpipe_checks as checks
from lightning_par.strategies import _pipeline_features as features
from lightning_par.strategies._base import ParStrategy


class GPipeStrategy(ParStrategy):
    """Pipeline parallelism with micro-batches and re-materialisation (GPipe).

    Args:
        balance: layers per stage (``len(balance)`` = number of devices); ``None`` balances
            automatically (``balance_by``).
        chunks: micro-batches per batch, ``M``; ``1`` is the naive layer-per-device split.
        checkpoint: re-materialisation, ``"never"``, ``"except_last"`` or ``"always"``;
            ``None``: ``"except_last"``, but ``"never"`` under ``"zero_bubble"`` (its B/W
            split keeps the activations for W).
        schedule: ``"gpipe"`` (all forwards, then all backwards), ``"1f1b"``,
            ``"interleaved"`` (interleaved 1F1B, ``virtual_stages`` stages per device) or
            ``"zero_bubble"`` (ZB-H1: backward split into input- and weight-gradient steps);
            see :mod:`lightning_par.pipeline.schedules_v`.
        virtual_stages: stages per device under ``"interleaved"`` (``v``; ``balance`` then
            has ``devices * v`` entries and ``chunks`` must be a multiple of ``devices``).
        module_attr: name of the ``nn.Sequential`` attribute of the LightningModule.
        loss_attr: name of its mean-reduced loss module (used by ``"1f1b"`` only).
        balance_by: automatic balance by ``"params"`` (parameter count) or ``"time"``
            (forward + backward time per layer on ``module.example_input_array``).
        deferred_batch_norm: BatchNorm layers keep their running statistics over the whole
            mini-batch (torchgpipe's; :mod:`lightning_par.pipeline.batchnorm`); each
            micro-batch is still normalised with its own statistics.
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
        checkpoint: str | None = None,
        schedule: str = "gpipe",
        module_attr: str = "net",
        loss_attr: str = "criterion",
        balance_by: str = "params",
        deferred_batch_norm: bool = False,
        virtual_stages: int = 2,
        **kwargs: Any,
    ) -> None:
        checkpoint = schedules.resolve_checkpoint(checkpoint, schedule)
        checks.check_settings(balance, chunks, checkpoint, schedule, balance_by)
        schedules.check_options(schedule, virtual_stages, checkpoint)
        self.virtual_stages = virtual_stages
        if not isinstance(deferred_batch_norm, bool):
            raise TypeError(f"deferred_batch_norm must be True or False: {deferred_batch_norm!r}")
        super().__init__(**kwargs)
        self.deferred_batch_norm = deferred_batch_norm
        self.balance, self.chunks, self.checkpoint = balance, chunks, checkpoint
        self.schedule, self.module_attr, self.loss_attr = schedule, module_attr, loss_attr
        self.balance_by = balance_by
        self._batch_checked = False

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
            module, net, stages=self.num_stages * self._v, balance=self.balance,
            balance_by=self.balance_by, rank=self.global_rank, broadcast=self.broadcast,
        )  # fmt: skip
        if self.deferred_batch_norm:
            defer_batch_norm(net)
        piped, first = schedules.build_network(
            net, balance, self.stage_comm, chunks=self.chunks, checkpoint=self.checkpoint,
            schedule=self.schedule, virtual_stages=self._v,
        )  # fmt: skip
        piped.to(self.root_device)
        send_weights_from_first(self.stage_comm, first, piped.state_dict(), self.root_device)
        setattr(module, self.module_attr, piped)

    def check_before_launch(self, trainer: pl.Trainer | None = None) -> None:
        """Reject a network, balance or loss this strategy cannot run, before any process
        starts (the launcher calls this in the main process)."""
        if self._layer_sync is not None:
            raise ValueError(
                f"{self.strategy_name} refuses sync_batchnorm=True: it synchronises BatchNorm "
                "over data-parallel replicas, but every stage holds different layers and sees "
                "the same batch; remove sync_batchnorm"
            )
        net = getattr(self.lightning_module, self.module_attr, None)
        if isinstance(net, nn.Module) and not isinstance(net, PipelinedSequential):
            features.warn_batchnorm(net, self.chunks, self.strategy_name, self.deferred_batch_norm)
        checks.check_before_launch(
            self.lightning_module, trainer, module_attr=self.module_attr,
            stages=self.num_stages, balance=self.balance,
            balance_by=self.balance_by, schedule=self.schedule, loss_attr=self.loss_attr,
            devices=self.parallel_devices or [], backend=self._process_group_backend,
            virtual_stages=self._v,
        )  # fmt: skip
        schedules.check_chunks(self.strategy_name, self.schedule, self.chunks, self.num_stages)

    @property
    def _v(self) -> int:
        """Stages per device: ``virtual_stages`` under ``"interleaved"``, else 1."""
        return self.virtual_stages if self.schedule == "interleaved" else 1

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        self._batch_checked = False
        if trainer.state.fn == TrainerFn.FITTING:
            self.precision_plugin.clip_grad_by_norm = self._clip_by_whole_norm
            scaler = getattr(self.precision_plugin, "scaler", None)
            if scaler is not None:
                features.agree_on_overflow(scaler)

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        try:
            super().setup_optimizers(trainer)
        except ValueError as err:
            if "empty parameter list" not in str(err):
                raise
            raise ValueError(
                f"{self.strategy_name}: stage {self.global_rank} has no trainable parameters "
                "(all frozen) and configure_optimizers left them out, so its optimiser is "
                "empty: give the optimiser the frozen parameters too (self.parameters()), "
                "to unfreeze them later, or choose a balance=[...] that gives every stage a "
                "trainable layer"
            ) from err

    def _clip_by_whole_norm(self, optimizer: Any, clip_val: float) -> None:
        """Lightning's clipping by norm, by the norm of every stage's gradients together."""
        stage_ids = {id(p) for p in self.pipelined.parameters()}
        params = list(self.precision_plugin.main_params(optimizer))
        features.clip_grad_norm_across_stages(
            [p for p in params if id(p) in stage_ids], clip_val,
            shared_params=[p for p in params if id(p) not in stage_ids],
            count_shared=self.stage_comm.rank == 0, group=self.stage_comm.group,
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
        if not self._batch_checked and self.num_stages > 1:
            stages = self.stage_comm
            features.check_same_batch(
                batch, stages.rank, self.num_stages, self.strategy_name, group=stages.group
            )
            self._batch_checked = True
        x = batch if isinstance(batch, torch.Tensor) else batch[0]
        if x.shape[0] < self.chunks:
            if self.lightning_module.trainer.global_step == 0:
                raise ValueError(
                    f"chunks={self.chunks} micro-batches but the batch has {x.shape[0]} samples: "
                    f"use chunks <= batch size"
                )
            rank_zero_warn(f"a batch of {x.shape[0]} < chunks={self.chunks} samples runs as "
                           f"{x.shape[0]} micro-batches")  # fmt: skip
        if self.schedule != "gpipe":
            if isinstance(batch, torch.Tensor) or len(batch) < 2:
                raise TypeError(f"schedule={self.schedule!r} needs batches of the form "
                                "(input, target, ...)")  # fmt: skip
            scale = 1.0 / self.lightning_module.trainer.accumulate_grad_batches
            loss_fn = getattr(self.lightning_module, self.loss_attr)
            with self.precision_plugin.train_step_context():
                self.pipelined.train_1f1b(x, batch[1], loss_fn, scale)
        return self._in_step("training_step", *args, **kwargs)

    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any):
        closure_loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        self.pipelined.backward()  # GPipe's backward half (1F1B already ran its backwards)
        if self.deferred_batch_norm:
            commit_batch_norm(self.pipelined)  # the mini-batch's running statistics, once
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

    def _stage_names(self, optimizer: Any) -> tuple[list[str], list[list[str]]]:
        """This stage's parameter names, in module order and per optimiser group."""
        named = list(self.lightning_module.named_parameters())
        by_id = {id(p): n for n, p in named}
        groups = [[by_id[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        return [n for n, _ in named], groups

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """On rank 0, the optimiser state of the whole model in the format of the user's
        optimiser in one process (so it resumes under any strategy); ``{}`` elsewhere."""
        state = super().optimizer_state(optimizer)
        names, groups = self._stage_names(getattr(optimizer, "_optimizer", optimizer))
        stages = gather_objects(self.stage_comm, (state, names, groups), self.root_device)
        if stages is None:
            return {}
        order = model_order([s[1] for s in stages], f"{self.module_attr}.")
        return merge_stage_states([s[0] for s in stages], [s[2] for s in stages], order)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Each stage takes its part of a whole-model optimiser state (written by any
        strategy or one process; every rank must call this)."""
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            if "pipeline_stages" in state:  # the per-stage format of earlier versions
                optimizer.load_state_dict(stage_optimizer_state(state, self.stage_comm.rank))
                continue
            mine = self._stage_names(optimizer)
            everyone: list[Any] = [mine]
            if dist.is_initialized() and self.num_stages > 1:
                everyone = [None] * self.num_stages
                dist.all_gather_object(everyone, mine, group=self.stage_comm.group)
            order = model_order([e[0] for e in everyone], f"{self.module_attr}.")
            part = stage_state(state, self.stage_comm.rank, [e[1] for e in everyone], order)
            optimizer.load_state_dict(part)
