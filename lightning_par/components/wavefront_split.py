"""The wavefront splitter: a stacked RNN's recurrent layers on consecutive ranks, the sequence
streamed through them ``time_chunk`` steps at a time.

:class:`WavefrontSplit` puts this rank's stage of ``module.<module_attr>`` (an
``nn.Sequential`` of recurrent layers, with any layers before and after them on the first
and last stage) in the network's place, as a
:class:`~lightning_par.modelparallel.wavefront.WavefrontSequential` (slides 003: "by the
time the signal propagates to the output layer, all devices are active simultaneously").
Used by ``layerwise(time_chunk=...)`` and the rows of ``hybrid(mp_kind="layerwise",
time_chunk=...)``; without ``time_chunk`` those cut any network with
:class:`~lightning_par.components.pipeline_split.PipelineSplit` (:func:`layerwise_split`).

Checkpoints hold the full model on rank 0 (stages keep the layers' original indices, so
their state dicts merge) and the whole model's optimiser state in one process's format
(:mod:`lightning_par.pipeline.optim_state`); clipping, ``16-mixed`` and the same-batch
check: :mod:`lightning_par.components.pipeline_features`.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_par.components import pipeline_checks as checks
from lightning_par.components import pipeline_features as features
from lightning_par.components.pipeline_options import LAYERWISE, PipelineOptions
from lightning_par.components.pipeline_split import PipelineSplit
from lightning_par.components.stage_split import StageSplit
from lightning_par.modelparallel.wavefront import (
    WavefrontSequential,
    recurrent_parts,
    wavefront_balance,
)
from lightning_par.pipeline.multistage import DeviceStages
from lightning_par.pipeline.optim_state import merge_stage_states, model_order, stage_state
from lightning_par.pipeline.partition import split_sequential
from lightning_par.pipeline.schedules import GPIPE
from lightning_par.pipeline.state import (
    gather_full_state_dict,
    gather_objects,
    send_weights_from_first,
    stage_optimizer_state,
)


def check_time_chunk(time_chunk: Any) -> int | None:
    """``time_chunk`` if it is an int >= 1 or None; otherwise a clear error."""
    if time_chunk is not None and (not isinstance(time_chunk, int) or time_chunk < 1):
        raise ValueError(f"time_chunk must be an int >= 1 or None, got {time_chunk!r}")
    return time_chunk


class WavefrontSplit(StageSplit):
    """This rank's stage of a stacked RNN, run as the wavefront (see the module docstring).

    Args: as :class:`~lightning_par.strategies.layerwise.LayerwiseStrategy`'s; ``time_chunk``
    is required here, and ``split_points`` refused (the recurrent layers are dealt by
    ``balance``).
    """

    def __init__(
        self,
        balance: list[int] | None = None,
        time_chunk: int | None = None,
        balance_by: str = "params",
        module_attr: str | None = None,
        split_points: list[str] | None = None,
    ) -> None:
        super().__init__()
        checks.check_settings(balance, 1, "never", balance_by)
        self.time_chunk = check_time_chunk(time_chunk)
        checks.check_split_points(balance, split_points)
        if split_points is not None:
            raise ValueError("time_chunk (the wavefront) splits an nn.Sequential of "
                             "recurrent layers by balance, not by split_points")  # fmt: skip
        self.balance, self.balance_by, self.module_attr = balance, balance_by, module_attr
        self.batch_checked = False

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.context.name if self.context is not None else "layerwise"

    @property
    def pipelined(self) -> WavefrontSequential:
        """This rank's stage, in the network's place (once split)."""
        net = getattr(self.module, self.attr, None)
        assert isinstance(net, WavefrontSequential), "not split yet"
        return net

    @property
    def held(self) -> tuple[nn.Module, DeviceStages]:
        """(this rank's stage, the runtime measuring its activations)."""
        return self.pipelined, self.pipelined.runtime

    # ---- before launch and splitting --------------------------------------------------------
    def check_before_launch(self, trainer: pl.Trainer | None) -> None:
        """Reject a network or balance the wavefront cannot run, before any process starts."""
        net = getattr(self.module, self.attr, None)
        if isinstance(net, WavefrontSequential):
            return
        if not isinstance(net, nn.Sequential):
            raise TypeError(
                f"{self.name}: time_chunk (the wavefront) streams the sequence through an "
                f"nn.Sequential of recurrent layers, and `{type(self.module).__name__}."
                f"{self.attr}` is a {type(net).__name__}: leave time_chunk out to cut any "
                "network layer-wise"
            )
        features.refuse_sync_batchnorm(self.context.sync_batchnorm, self.name)
        if trainer is None or trainer.state.fn == TrainerFn.FITTING:
            features.warn_dropout(net, self.name)
        # one micro-batch under GPipe's order: no schedule, loss or backend to check
        checks.check_before_launch(
            self.module, trainer, module_attr=self.attr, stages=self.size, balance=self.balance,
            balance_by=self.balance_by, schedule=GPIPE, loss_attr="criterion", devices=[],
            backend=None, who=self.name,
        )  # fmt: skip
        recurrent_parts(net, self.balance or wavefront_balance(net, self.size))

    def split(self, trainer: pl.Trainer) -> None:
        net = getattr(self.module, self.attr, None)
        if isinstance(net, WavefrontSequential):
            return
        self.check_before_launch(self.module.trainer)
        balance = self.balance or wavefront_balance(net, self.size)
        piped = WavefrontSequential(net, balance, self.comm, self.time_chunk)
        first = None
        if self.comm.rank == 0:  # every stage starts from rank 0's weights
            first = [s.state_dict() for s in split_sequential(net, balance)]
        device = self.context.root_device
        piped.to(device)
        send_weights_from_first(self.comm, first, piped.state_dict(), device)
        setattr(self.module, self.attr, piped)

    def clipped_parameters(self) -> tuple[set[int], set[int]]:
        stage = {id(p) for p in self.pipelined.parameters()}
        return stage, stage  # the stage is in the network's place

    def running_part(self) -> WavefrontSequential:
        return self.pipelined

    # ---- steps ------------------------------------------------------------------------------
    def before_training_step(self, batch: Any) -> None:
        self.check_batch_once(batch)
        features.check_batch_size(batch, 1, self.module.trainer.global_step == 0)

    def after_backward(self) -> None:
        self.pipelined.backward()  # the backward wavefront

    def micro_batched_runtime(self) -> Any:
        return self.pipelined.runtime

    # ---- checkpoints: the full model on rank 0 ----------------------------------------------
    def full_state_dict(self, local: dict[str, Any]) -> dict[str, Any]:
        """The full model's state dict on rank 0 (every stage's layers, original names)."""
        return gather_full_state_dict(self.comm, local, f"{self.attr}.", self.context.root_device)

    def _stage_names(self, optimizer: Any) -> tuple[list[str], list[list[str]]]:
        """This stage's parameter names, in module order and per optimiser group."""
        named = list(self.module.named_parameters())
        by_id = {id(p): n for n, p in named}
        groups = [[by_id[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        return [n for n, _ in named], groups

    def full_optimizer_state(self, local: dict[str, Any], optimizer: Any) -> dict[str, Any]:
        """On rank 0, the optimiser state of the whole model in the format of the user's
        optimiser in one process (so it resumes under any strategy); ``{}`` elsewhere."""
        names, groups = self._stage_names(getattr(optimizer, "_optimizer", optimizer))
        stages = gather_objects(self.comm, (local, names, groups), self.context.root_device)
        if stages is None:
            return {}
        order = model_order([s[1] for s in stages], f"{self.attr}.")
        return merge_stage_states([s[0] for s in stages], [s[2] for s in stages], order)

    def load_optimizer_states(self, optimizers: list[Any], states: list[Any]) -> bool:
        """Each stage takes its part of a whole-model optimiser state (written by any
        strategy or one process; every rank must call this)."""
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


def layerwise_split(
    balance: list[int] | None = None, time_chunk: int | None = None,
    balance_by: str = "params", module_attr: str | None = None,
    split_points: list[str] | None = None,
) -> StageSplit:  # fmt: skip
    """The layer-wise split (``LayerwiseStrategy``, ``hybrid(mp_kind="layerwise")``): the
    wavefront with ``time_chunk``; else any network cut into stages run with one
    micro-batch and no re-materialisation (:data:`~.pipeline_options.LAYERWISE`)."""
    if time_chunk is not None:
        return WavefrontSplit(balance, time_chunk, balance_by, module_attr, split_points)
    return PipelineSplit(PipelineOptions.of(locals(), **LAYERWISE))
