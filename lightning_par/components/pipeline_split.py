"""The pipeline splitter: consecutive layers of an ``nn.Sequential`` on consecutive ranks.

:class:`PipelineSplit` cuts ``module.<module_attr>`` into one stage per rank of its
communicator and runs the stages (the algorithms are in :mod:`lightning_par.pipeline` and
:mod:`lightning_par.modelparallel`):

* GPipe (Huang et al., 2019) or 1F1B (Narayanan et al., PipeDream, 2019) over ``chunks``
  micro-batches, with re-materialisation (``checkpoint``);
* ``chunks=1, checkpoint="never"``: the naive layer-wise split (slides 003);
* ``time_chunk=t``: the stacked-RNN wavefront of :mod:`lightning_par.modelparallel.wavefront`
  (the sequence streams through the recurrent stages ``t`` time steps at a time).

Used by ``gpipe``, ``layerwise`` and the rows of ``hybrid``, each of which hands it one
:class:`~lightning_par.components.pipeline_options.PipelineOptions` (the schedule already
looked up: a :class:`~lightning_par.pipeline.schedules.Schedule`). Checkpoints hold the full
model on rank 0 and the whole model's optimiser state in one process's format
(:mod:`lightning_par.pipeline.optim_state`); clipping, ``16-mixed`` and the same-batch
check: :mod:`lightning_par.components.pipeline_features`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_par import _compat
from lightning_par.components import pipeline_checks as checks
from lightning_par.components import pipeline_features as features
from lightning_par.components import pipeline_loss as losses
from lightning_par.components.graph_pipeline import GraphPipeline, try_cut
from lightning_par.components.pipeline_options import PipelineOptions
from lightning_par.components.splitter import ModelSplitter, find_network
from lightning_par.modelparallel.wavefront import (
    WavefrontSequential,
    recurrent_parts,
    wavefront_balance,
)
from lightning_par.pipeline.batchnorm import commit_batch_norm, defer_batch_norm
from lightning_par.pipeline.optim_state import merge_stage_states, model_order, stage_state
from lightning_par.pipeline.options import build_network
from lightning_par.pipeline.partition import split_sequential
from lightning_par.pipeline.schedules import Schedule
from lightning_par.pipeline.sequential import PipelinedSequential
from lightning_par.pipeline.state import (
    gather_full_state_dict,
    gather_objects,
    send_weights_from_first,
    stage_optimizer_state,
)


class PipelineSplit(ModelSplitter):
    """One stage of ``module.<module_attr>`` per rank (see the module docstring).

    Args:
        options: the checked options (``None``: every default), see
            :class:`~lightning_par.components.pipeline_options.PipelineOptions`.
    """

    def __init__(self, options: PipelineOptions | None = None) -> None:
        super().__init__()
        self.options = o = options if options is not None else PipelineOptions()
        self.schedule: Schedule = o.schedule  # looked up by PipelineOptions
        self.balance, self.chunks, self.checkpoint = o.balance, o.chunks, o.checkpoint
        self.module_attr, self.loss_attr, self.balance_by = o.module_attr, o.loss_attr, o.balance_by
        self.loss_fn, self.target_index = o.loss_fn, o.target_index
        self.virtual_stages, self.time_chunk = o.virtual_stages, o.time_chunk
        self.deferred_batch_norm, self.split_points = o.deferred_batch_norm, o.split_points
        self.batch_checked = False
        self.loss_scale: float | None = None  # a scheduled step's, until its backward
        self.graph: GraphPipeline | None = None  # the any-network path, once split

    @property
    def materializes_meta(self) -> bool:  # type: ignore[override]
        return self.time_chunk is None  # the graph path (the wavefront keeps a Sequential)

    @property
    def stages_per_device(self) -> int:
        """Stages each rank holds under the schedule (``virtual_stages`` when interleaved)."""
        return self.schedule.stages_per_device(self.virtual_stages)

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.strategy.strategy_name if self.strategy is not None else "gpipe"

    @property
    def pipelined(self) -> nn.Module:
        """The split network (a :class:`PipelinedSequential` or :class:`WavefrontSequential`)."""
        net = getattr(self.module, self.attr, None)
        assert isinstance(net, (PipelinedSequential, WavefrontSequential)), "not split yet"
        return net

    @property
    def held(self) -> tuple[nn.Module, Any]:
        """(the module holding this device's layers, the runtime measuring its activations):
        the user's network (what other devices hold is empty) or the split Sequential."""
        if self.graph is not None:
            return getattr(self.module, self.attr), self.graph.network.stages
        return self.pipelined, self.pipelined.runtime

    @property
    def attr(self) -> str:
        """The LightningModule's attribute holding the network (``module_attr``, or found)."""
        return find_network(self.module, self.module_attr, self.name)

    def by_graph(self, net: Any) -> bool:
        """Whether ``net`` is cut from its traced graph and run in place (every network but
        the wavefront's ``nn.Sequential`` of recurrent layers)."""
        if self.graph is not None or isinstance(net, (PipelinedSequential, WavefrontSequential)):
            return self.graph is not None
        return self.time_chunk is None

    # ---- before launch ----------------------------------------------------------------------
    def check_before_launch(self, trainer: pl.Trainer | None) -> None:
        """Reject a network, balance or loss this split cannot run, before any process
        starts (the launcher calls this in the main process)."""
        net = getattr(self.module, self.attr, None)
        if isinstance(net, WavefrontSequential):
            return
        if self.time_chunk is not None and not isinstance(net, nn.Sequential):
            raise TypeError(
                f"{self.name}: time_chunk (the wavefront) streams the sequence through an "
                f"nn.Sequential of recurrent layers, and `{type(self.module).__name__}."
                f"{self.attr}` is a {type(net).__name__}: leave time_chunk out to cut any "
                "network layer-wise"
            )
        if _compat.layer_sync(self.strategy) is not None:
            raise ValueError(
                f"{self.name} refuses sync_batchnorm=True: it synchronises BatchNorm "
                "over data-parallel replicas, but every stage holds different layers and sees "
                "the same batch; remove sync_batchnorm"
            )
        if isinstance(net, nn.Module) and not isinstance(net, PipelinedSequential):
            features.warn_batchnorm(net, self.chunks, self.name, self.deferred_batch_norm)
            if trainer is None or trainer.state.fn == TrainerFn.FITTING:
                features.warn_dropout(net, self.name)
        if self.by_graph(net):
            if isinstance(net, nn.Sequential) and self.split_points is None:
                checks.check_before_launch(
                    self.module, trainer, module_attr=self.attr, stages=self.size,
                    balance=self.balance, balance_by=self.balance_by, schedule=self.schedule,
                    loss_attr=self.loss_attr, devices=self.strategy.parallel_devices or [],
                    backend=_compat.process_group_backend(self.strategy),
                    virtual_stages=self.stages_per_device, loss_fn=self.loss_fn, who=self.name,
                )  # fmt: skip
            self.schedule.check_chunks(self.chunks, self.size, self.name)
            backend = _compat.process_group_backend(self.strategy)
            devices = self.strategy.parallel_devices or []
            if devices and devices[0].type == "cuda":
                checks.check_backend(self.schedule, backend or "nccl")
            if self.schedule.loss_per_micro_batch:
                checks.check_1f1b_loss(self.module, self.loss_attr, self.schedule, self.loss_fn,
                                       self.name)  # fmt: skip
            if self.graph is None:  # with an example input, an unsplittable network stops here
                try_cut(
                    self.module,
                    self.attr,
                    self.split_points,
                    self.size * self.stages_per_device,
                    self.balance_by,
                    self.name,
                    trainer,
                )
            return
        checks.check_before_launch(
            self.module, trainer, module_attr=self.attr,
            stages=self.size, balance=self.balance,
            balance_by=self.balance_by, schedule=self.schedule, loss_attr=self.loss_attr,
            devices=self.strategy.parallel_devices or [],
            backend=_compat.process_group_backend(self.strategy),
            virtual_stages=self.stages_per_device, loss_fn=self.loss_fn, who=self.name,
        )  # fmt: skip
        self.schedule.check_chunks(self.chunks, self.size, self.name)
        if self.time_chunk is not None and isinstance(net, nn.Sequential):
            recurrent_parts(net, self.balance or wavefront_balance(net, self.size))

    # ---- splitting --------------------------------------------------------------------------
    def split(self, trainer: pl.Trainer) -> None:
        checks.check_trainer(trainer, self.schedule, self.strategy.precision_plugin)
        checks.check_backend(self.schedule, _compat.process_group_backend(self.strategy))
        net = getattr(self.module, self.attr, None)
        if isinstance(net, (PipelinedSequential, WavefrontSequential)) or self.graph is not None:
            return
        self.check_before_launch(self.module.trainer)
        device = self.strategy.root_device
        if self.by_graph(net):
            points = self.split_points
            if points is None and isinstance(net, nn.Sequential):  # by balance, as layers
                balance = checks.resolve_balance(
                    self.module, net, stages=self.size * self.stages_per_device,
                    balance=self.balance, balance_by=self.balance_by,
                    rank=self.strategy.global_rank, broadcast=self.strategy.broadcast,
                )  # fmt: skip
                names = [name for name, _ in net.named_children()]
                points = [names[sum(balance[:i])] for i in range(1, len(balance))]
            self.graph = GraphPipeline(
                self.module, self.attr, self.comm, split_points=points,
                balance_by=self.balance_by, chunks=self.chunks, schedule=self.schedule,
                virtual_stages=self.stages_per_device, checkpoint=self.checkpoint,
                deferred_batch_norm=self.deferred_batch_norm, trainer=trainer, who=self.name,
            )  # fmt: skip
            return
        if self.time_chunk is None:
            balance = checks.resolve_balance(
                self.module, net, stages=self.size * self.stages_per_device,
                balance=self.balance, balance_by=self.balance_by,
                rank=self.strategy.global_rank, broadcast=self.strategy.broadcast,
            )  # fmt: skip
            if self.deferred_batch_norm:
                defer_batch_norm(net)
            piped, first = build_network(
                net, balance, self.comm, chunks=self.chunks, checkpoint=self.checkpoint,
                schedule=self.schedule, virtual_stages=self.stages_per_device,
            )  # fmt: skip
        else:
            balance = self.balance or wavefront_balance(net, self.size)
            piped = WavefrontSequential(net, balance, self.comm, self.time_chunk)
            first = None
            if self.comm.rank == 0:
                first = [s.state_dict() for s in split_sequential(net, balance)]
        piped.to(device)
        send_weights_from_first(self.comm, first, piped.state_dict(), device)
        setattr(self.module, self.attr, piped)

    def after_setup(self, trainer: pl.Trainer) -> None:
        self.batch_checked = False
        if trainer.state.fn == TrainerFn.FITTING:
            precision = self.strategy.precision_plugin
            _compat.replace_clip_grad_by_norm(precision, self._clip_by_whole_norm)
            scaler = getattr(precision, "scaler", None)
            if scaler is not None:
                features.agree_on_overflow(scaler)

    def explain_optimizer_error(self, error: ValueError) -> ValueError | None:
        if "empty parameter list" not in str(error):
            return None
        return ValueError(
            f"{self.name}: stage {self.strategy.global_rank} has no trainable parameters "
            "(all frozen) and configure_optimizers left them out, so its optimiser is "
            "empty: give the optimiser the frozen parameters too (self.parameters()), "
            "to unfreeze them later, or choose a balance=[...] that gives every stage a "
            "trainable layer"
        )

    def _clip_by_whole_norm(self, optimizer: Any, clip_val: float) -> None:
        """Lightning's clipping by norm, by the norm of every stage's gradients together."""
        params = list(self.strategy.precision_plugin.main_params(optimizer))
        if self.graph is not None:  # a tied parameter counts once, on its first device
            network = self.graph.network
            counted = {id(p) for p in network.counted_parameters()}
            outside = {id(p) for p in getattr(self.module, self.attr).parameters()}
            features.clip_grad_norm_across_stages(
                [p for p in params if id(p) in counted], clip_val,
                shared_params=[p for p in params if id(p) not in outside],
                count_shared=self.comm.rank == 0, group=self.comm.group,
            )  # fmt: skip
            return
        stage_ids = {id(p) for p in self.pipelined.parameters()}
        features.clip_grad_norm_across_stages(
            [p for p in params if id(p) in stage_ids], clip_val,
            shared_params=[p for p in params if id(p) not in stage_ids],
            count_shared=self.comm.rank == 0, group=self.comm.group,
        )  # fmt: skip

    # ---- steps ------------------------------------------------------------------------------
    def before_training_step(self, batch: Any) -> None:
        if not self.batch_checked and self.size > 1:
            features.check_same_batch(
                batch, self.comm.rank, self.size, self.name, group=self.comm.group
            )
            self.batch_checked = True
        x = batch if isinstance(batch, torch.Tensor) else batch[0]
        if x.shape[0] < self.chunks:
            if self.module.trainer.global_step == 0:
                raise ValueError(
                    f"chunks={self.chunks} micro-batches but the batch has {x.shape[0]} samples: "
                    f"use chunks <= batch size"
                )
            rank_zero_warn(f"a batch of {x.shape[0]} < chunks={self.chunks} samples runs as "
                           f"{x.shape[0]} micro-batches")  # fmt: skip
        if self.schedule.loss_per_micro_batch:  # 1F1B and past it: the loss computed here
            target = losses.batch_target(batch, self.target_index, self.name, self.schedule)
            scale = 1.0 / self.module.trainer.accumulate_grad_batches
            loss_fn = losses.resolve_loss(self.module, self.loss_fn, self.loss_attr)
            self.loss_scale = scale  # before_backward compares the loss the step returns
            if self.graph is not None:  # the network's forward runs the schedule
                self.graph.network.expect(target, loss_fn, scale)
                return
            with self.strategy.precision_plugin.train_step_context():
                self.pipelined.train_1f1b(x, target, loss_fn, scale)

    @contextmanager
    def running(self) -> Iterator[None]:
        net = self.graph.network if self.graph is not None else self.pipelined
        net.active = True  # every stage runs forward now
        try:
            yield
        finally:
            net.active = False

    def before_backward(self, closure_loss: Any) -> None:
        scale, self.loss_scale = self.loss_scale, None
        if scale is None or not isinstance(closure_loss, torch.Tensor) or closure_loss.numel() != 1:
            return  # GPipe back-propagates the loss returned; or no scheduled step pending
        net = self.graph.network if self.graph is not None else self.pipelined
        computed, net.last_loss = net.last_loss, None
        table = losses.gather_losses(closure_loss, computed, self.size, self.comm.group)
        losses.check_returned_loss(table, scale, who=self.name, schedule=self.schedule,
                                   loss=losses.loss_name(self.loss_fn, self.loss_attr))  # fmt: skip

    def after_backward(self) -> None:
        if self.graph is not None:
            self.graph.after_backward()
            return
        self.pipelined.backward()  # GPipe's backward half (1F1B already ran its backwards)
        if self.deferred_batch_norm:
            commit_batch_norm(self.pipelined)  # the mini-batch's running statistics, once

    def micro_batched_runtime(self) -> Any:
        return self.graph.network if self.graph is not None else self.pipelined.runtime

    def early_buckets_exact(self) -> bool:
        # GPipe's backward half starts after the last forward; the graph path's backward is
        # not cut at the last micro-batch: buckets wait for all
        return not self.schedule.loss_per_micro_batch and self.graph is None

    # ---- checkpoints: the full model on rank 0 ----------------------------------------------
    def full_state_dict(self, local: dict[str, Any]) -> dict[str, Any]:
        """The full model's state dict on rank 0 (every stage's layers, original names)."""
        if self.graph is not None:
            local = self.graph.held(local)
        return gather_full_state_dict(self.comm, local, f"{self.attr}.", self.strategy.root_device)

    def piece_state_dict(self, full: Mapping[str, Any]) -> Mapping[str, Any]:
        return self.graph.piece_state_dict(dict(full)) if self.graph is not None else full

    def _stage_names(self, optimizer: Any) -> tuple[list[str], list[list[str]]]:
        """This stage's parameter names, in module order and per optimiser group."""
        named = list(self.module.named_parameters())
        by_id = {id(p): n for n, p in named}
        groups = [[by_id[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        return [n for n, _ in named], groups

    def full_optimizer_state(self, local: dict[str, Any], optimizer: Any) -> dict[str, Any]:
        """On rank 0, the optimiser state of the whole model in the format of the user's
        optimiser in one process (so it resumes under any strategy); ``{}`` elsewhere."""
        if self.graph is not None:
            return self.graph.full_optimizer_state(local, optimizer)
        names, groups = self._stage_names(getattr(optimizer, "_optimizer", optimizer))
        device = self.strategy.root_device
        stages = gather_objects(self.comm, (local, names, groups), device)
        if stages is None:
            return {}
        order = model_order([s[1] for s in stages], f"{self.attr}.")
        return merge_stage_states([s[0] for s in stages], [s[2] for s in stages], order)

    def load_optimizer_states(self, optimizers: list[Any], states: list[Any]) -> bool:
        """Each stage takes its part of a whole-model optimiser state (written by any
        strategy or one process; every rank must call this)."""
        if self.graph is not None:
            self.graph.load_optimizer_states(optimizers, states)
            return True
        for optimizer, state in zip(optimizers, states):
            if "pipeline_stages" in state:  # the per-stage format of earlier versions
                optimizer.load_state_dict(stage_optimizer_state(state, self.comm.rank))
                continue
            mine = self._stage_names(optimizer)
            everyone: list[Any] = [mine]
            if dist.is_initialized() and self.size > 1:
                everyone = [None] * self.size
                dist.all_gather_object(everyone, mine, group=self.comm.group)
            order = model_order([e[0] for e in everyone], f"{self.attr}.")
            part = stage_state(state, self.comm.rank, [e[1] for e in everyone], order)
            optimizer.load_state_dict(part)
        return True
