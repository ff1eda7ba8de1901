"""The pipeline splitter: the user's network cut into stages, one device's stages per rank.

:class:`PipelineSplit` cuts ``module.<module_attr>`` (any network: an ``nn.Sequential`` is
cut between its layers, by ``balance``; any other from its traced graph, at ``split_points``
or balanced) into ``K`` stages (``K * virtual_stages`` under ``"interleaved"``) and runs
them in place (:mod:`~lightning_par.components.graph_pipeline`, on the one stage runtime
:class:`~lightning_par.pipeline.multistage.DeviceStages`):

* GPipe (Huang et al., 2019) or 1F1B (Narayanan et al., PipeDream, 2019) over ``chunks``
  micro-batches, with re-materialisation (``checkpoint``); interleaved 1F1B (Narayanan et
  al., 2021) and zero bubble (Qi et al., 2023);
* ``chunks=1, checkpoint="never"``: the naive layer-wise split (slides 003).

Used by ``gpipe``, ``layerwise`` (without ``time_chunk``; the RNN wavefront is
:class:`~lightning_par.components.wavefront_split.WavefrontSplit`) and the rows of
``hybrid``, each of which hands it one
:class:`~lightning_par.components.pipeline_options.PipelineOptions` (the schedule already
looked up: a :class:`~lightning_par.pipeline.schedules.Schedule`). Checkpoints hold the full
model on rank 0 and the whole model's optimiser state in one process's format; clipping,
``16-mixed`` and the same-batch check: :mod:`lightning_par.components.pipeline_features`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_par.components import pipeline_checks as checks
from lightning_par.components import pipeline_features as features
from lightning_par.components import pipeline_loss as losses
from lightning_par.components.graph_pipeline import GraphPipeline, try_cut
from lightning_par.components.pipeline_options import PipelineOptions
from lightning_par.components.stage_split import StageSplit
from lightning_par.pipeline.multistage import DeviceStages
from lightning_par.pipeline.network import PipelinedNetwork
from lightning_par.pipeline.schedules import Schedule
from lightning_par.pipeline.state import gather_full_state_dict


class PipelineSplit(StageSplit):
    """The network of ``module.<module_attr>`` as pipeline stages (see the module docstring).

    Args:
        options: the checked options (``None``: every default), see
            :class:`~lightning_par.components.pipeline_options.PipelineOptions`.
    """

    #: a network built on the meta device gets storage for this device's stages only
    materializes_meta = True

    def __init__(self, options: PipelineOptions | None = None) -> None:
        super().__init__()
        self.options = o = options if options is not None else PipelineOptions()
        self.schedule: Schedule = o.schedule  # looked up by PipelineOptions
        self.balance, self.chunks, self.checkpoint = o.balance, o.chunks, o.checkpoint
        self.module_attr, self.loss_attr, self.balance_by = o.module_attr, o.loss_attr, o.balance_by
        self.loss_fn, self.target_index = o.loss_fn, o.target_index
        self.virtual_stages, self.split_points = o.virtual_stages, o.split_points
        self.deferred_batch_norm = o.deferred_batch_norm
        self.batch_checked = False
        self.loss_scale: float | None = None  # a scheduled step's, until its backward
        self.graph: GraphPipeline | None = None  # the network's stages, once split

    @property
    def stages_per_device(self) -> int:
        """Stages each rank holds under the schedule (``virtual_stages`` when interleaved)."""
        return self.schedule.stages_per_device(self.virtual_stages)

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.context.name if self.context is not None else "gpipe"

    @property
    def network(self) -> PipelinedNetwork:
        """The network's pipeline on this device (once split)."""
        assert self.graph is not None, "not split yet"
        return self.graph.network

    @property
    def held(self) -> tuple[nn.Module, DeviceStages]:
        """(the user's network, of which this device holds its stages' part; the runtime
        measuring their activations)."""
        return getattr(self.module, self.attr), self.network.stages

    # ---- before launch ----------------------------------------------------------------------
    def check_before_launch(self, trainer: pl.Trainer | None) -> None:
        """Reject a network, balance or loss this split cannot run, before any process
        starts (the launcher calls this in the main process)."""
        net = getattr(self.module, self.attr, None)
        features.refuse_sync_batchnorm(self.context.sync_batchnorm, self.name)
        features.warn_batchnorm(net, self.chunks, self.name, self.deferred_batch_norm)
        if trainer is None or trainer.state.fn == TrainerFn.FITTING:
            features.warn_dropout(net, self.name)
        backend = self.context.backend
        devices = self.context.devices
        if isinstance(net, nn.Sequential) and self.split_points is None:
            checks.check_before_launch(
                self.module, trainer, module_attr=self.attr, stages=self.size,
                balance=self.balance, balance_by=self.balance_by, schedule=self.schedule,
                loss_attr=self.loss_attr, devices=devices, backend=backend,
                virtual_stages=self.stages_per_device, loss_fn=self.loss_fn, who=self.name,
            )  # fmt: skip
        self.schedule.check_chunks(self.chunks, self.size, self.name)
        if devices and devices[0].type == "cuda":
            checks.check_backend(self.schedule, backend or "nccl")
        if self.schedule.loss_per_micro_batch:
            checks.check_1f1b_loss(self.module, self.loss_attr, self.schedule, self.loss_fn,
                                   self.name)  # fmt: skip
        if self.graph is None:  # with an example input, an unsplittable network stops here
            stages = self.size * self.stages_per_device
            try_cut(self.module, self.attr, self.split_points, stages, self.balance_by,
                    self.name, trainer)  # fmt: skip

    # ---- splitting --------------------------------------------------------------------------
    def split(self, trainer: pl.Trainer) -> None:
        checks.check_trainer(trainer, self.schedule, self.context.precision)
        checks.check_backend(self.schedule, self.context.backend)
        if self.graph is not None:
            return
        self.check_before_launch(self.module.trainer)
        self.graph = GraphPipeline(
            self.module, self.attr, self.comm, split_points=self._split_points(),
            balance_by=self.balance_by, chunks=self.chunks, schedule=self.schedule,
            virtual_stages=self.stages_per_device, checkpoint=self.checkpoint,
            deferred_batch_norm=self.deferred_batch_norm, trainer=trainer, who=self.name,
        )  # fmt: skip

    def _split_points(self) -> list[str] | None:
        """The given split points; for an ``nn.Sequential``, the first layer of each stage
        after the first, by ``balance`` (given, by parameters, or timed on rank 0)."""
        net = getattr(self.module, self.attr)
        if self.split_points is not None or not isinstance(net, nn.Sequential):
            return self.split_points
        balance = checks.resolve_balance(
            self.module, net, stages=self.size * self.stages_per_device, balance=self.balance,
            balance_by=self.balance_by, rank=self.context.rank,
            broadcast=self.context.broadcast,
        )  # fmt: skip
        names = [name for name, _ in net.named_children()]
        return [names[sum(balance[:i])] for i in range(1, len(balance))]

    def clipped_parameters(self) -> tuple[set[int], set[int]]:
        # a tied parameter counts once, on its first device
        counted = {id(p) for p in self.network.counted_parameters()}
        return counted, {id(p) for p in getattr(self.module, self.attr).parameters()}

    def running_part(self) -> PipelinedNetwork:
        return self.network

    # ---- steps ------------------------------------------------------------------------------
    def before_training_step(self, batch: Any) -> None:
        self.check_batch_once(batch)
        features.check_batch_size(batch, self.chunks, self.module.trainer.global_step == 0)
        if self.schedule.loss_per_micro_batch:  # 1F1B and past it: the forward runs it all
            target = losses.batch_target(batch, self.target_index, self.name, self.schedule)
            scale = 1.0 / self.module.trainer.accumulate_grad_batches
            loss_fn = losses.resolve_loss(self.module, self.loss_fn, self.loss_attr)
            self.loss_scale = scale  # before_backward compares the loss the step returns
            self.network.expect(target, loss_fn, scale)

    def before_backward(self, closure_loss: Any) -> None:
        scale, self.loss_scale = self.loss_scale, None
        if scale is None or not isinstance(closure_loss, torch.Tensor) or closure_loss.numel() != 1:
            return  # GPipe back-propagates the loss returned; or no scheduled step pending
        computed, self.network.last_loss = self.network.last_loss, None
        table = losses.gather_losses(closure_loss, computed, self.size, self.comm.group)
        losses.check_returned_loss(table, scale, who=self.name, schedule=self.schedule,
                                   loss=losses.loss_name(self.loss_fn, self.loss_attr))  # fmt: skip

    def after_backward(self) -> None:
        assert self.graph is not None, "not split yet"
        self.graph.after_backward()

    def micro_batched_runtime(self) -> Any:
        return self.network

    def early_buckets_exact(self) -> bool:
        # the backward is not cut at the last micro-batch (tied parameters are summed after
        # it, the scheduled forward hands its gradients over late): buckets wait for all
        return False

    # ---- checkpoints: the full model on rank 0 ----------------------------------------------
    def full_state_dict(self, local: dict[str, Any]) -> dict[str, Any]:
        """The full model's state dict on rank 0 (every stage's layers, original names)."""
        held = self.graph.held(local) if self.graph is not None else local
        return gather_full_state_dict(self.comm, held, f"{self.attr}.", self.context.root_device)

    def piece_state_dict(self, full: Mapping[str, Any]) -> Mapping[str, Any]:
        return self.graph.piece_state_dict(dict(full)) if self.graph is not None else full

    def full_optimizer_state(self, local: dict[str, Any], optimizer: Any) -> dict[str, Any]:
        """On rank 0, the optimiser state of the whole model in the format of the user's
        optimiser in one process (so it resumes under any strategy); ``{}`` elsewhere."""
        return self.graph.full_optimizer_state(local, optimizer) if self.graph else local

    def load_optimizer_states(self, optimizers: list[Any], states: list[Any]) -> bool:
        """Each stage takes its part of a whole-model optimiser state (written by any
        strategy or one process; every rank must call this)."""
        if self.graph is None:
            return False
        self.graph.load_optimizer_states(optimizers, states)
        return True
