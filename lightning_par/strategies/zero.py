"""Sharded data parallelism: ZeRO stages 1, 2 and 3 on the ring's two phases, CPU or GPU.

ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020, arXiv:1910.02054) removes data parallelism's redundancy: instead of every
rank holding the whole optimizer state, gradients and parameters, each holds a ``1/p``
slice of the optimizer state (stage 1), of the gradients too (stage 2) and of the
parameters too (stage 3, PyTorch FSDP's "fully sharded" data parallelism). With Adam in
fp32 a rank holds ``4Ψ + 4Ψ + 8Ψ`` bytes for ``Ψ`` parameters under data parallelism; the
stages divide the terms they shard by ``p``. The ring allreduce is a reduce-scatter and an
all-gather; the stages use the two phases apart
(:func:`~lightning_par.collectives.ring_reduce_scatter`,
:func:`~lightning_par.collectives.ring_all_gather`): stage 2 sends the ring's bytes, stage 3
1.5 times them (the parameters gathered for forward and again for backward), stage 1, which
keeps ``ring_allreduce``'s allreduce so that its sums are the same bits, adds one
all-gather of the new weights to it.

:class:`ZeroStrategy` is a thin adapter over
:class:`~lightning_par.strategies._base.ParStrategy` and the component
:class:`~lightning_par.components.zero_shards.ZeroShards`, which answers the split-model
hooks (steps, checkpoints) and the gradient synchronisation hooks below.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_par.collectives import tree_broadcast
from lightning_par.components.zero_shards import ZeroShards
from lightning_par.strategies._base import ParStrategy
from lightning_par.strategies._split_context import StrategyContext
from lightning_par.zero.sharded_checkpoint import is_sharded_checkpoint, read_meta

STAGES = (1, 2, 3)


class ZeroStrategy(ParStrategy):
    """Data parallelism whose optimizer state (stage 1), gradients (2) and parameters (3)
    are sharded over the ranks.

    Args:
        stage: 1, 2 or 3 (default 3, parameters sharded too).
        bucket_cap_mb: the largest flat unit of stages 1-2, in MiB (stage 3 makes one unit
            per layer).
        elementwise_optimizers: optimizer classes of your own whose update is element-wise
            (torch's SGD, Adam, AdamW, RMSprop, Adagrad, ... are known already).
        checkpoint: ``"whole"`` (default): checkpoints in one process's format, the shards
            gathered, loadable anywhere; ``"sharded"``: each rank writes its own shards into
            a folder (torch's distributed checkpoint), for models that do not fit one rank;
            it resumes ``zero`` on as many ranks, and ``python -m lightning_par.zero
            consolidate`` turns it into one process's.
        fault_tolerant: refused (``True`` raises, saying why): a lost rank's shard of
            the state exists nowhere else; ``ring_allreduce(fault_tolerant=True)`` goes on.
        **kwargs: ``trace``, ``trace_dir``, ``start_method``, ``process_group_backend``,
            ``timeout`` (see :class:`~lightning_par.strategies._base.ParStrategy`).
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int = 3,
        bucket_cap_mb: float = 4.0,
        elementwise_optimizers: Sequence[type] = (),
        checkpoint: str = "whole",
        fault_tolerant: bool = False,
        **kwargs: Any,
    ) -> None:
        if fault_tolerant is not False:
            held = {1: "optimizer state", 2: "optimizer state and gradients"}.get(
                stage, "optimizer state, gradients and parameters"
            )
            raise ValueError(
                f"zero(stage={stage}) cannot be fault_tolerant: each rank holds the only copy "
                f"of its shard of the {held}, so a lost rank's shard exists nowhere else. Use "
                "ring_allreduce(fault_tolerant=True) (every rank holds everything), or keep "
                "zero and resume from checkpoints (ModelCheckpoint, checkpoint='sharded')"
            )
        if isinstance(stage, bool) or stage not in STAGES:
            raise ValueError(
                f"zero: stage must be 1 (optimizer state sharded), 2 (and gradients) or 3 "
                f"(and parameters), got {stage!r}; e.g. ZeroStrategy(stage=2) or "
                "--trainer.strategy.stage=2"
            )
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
            raise TypeError(f"zero: bucket_cap_mb must be a number of MiB, got {bucket_cap_mb!r}")
        if not bucket_cap_mb > 0:
            raise ValueError(f"zero: bucket_cap_mb must be > 0 MiB, got {bucket_cap_mb}")
        for cls in elementwise_optimizers:
            if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
                raise TypeError(
                    "zero: elementwise_optimizers takes optimizer classes (subclasses of "
                    f"torch.optim.Optimizer), got {cls!r}"
                )
        if checkpoint not in ("whole", "sharded"):
            raise ValueError(
                f"zero: checkpoint must be 'whole' (one process's format) or 'sharded' (each "
                f"rank's shards, for models that do not fit one rank), got {checkpoint!r}"
            )
        super().__init__(**kwargs)
        self.stage = stage
        self.checkpoint = checkpoint
        self._sharded_resume: Any = None
        self.bucket_cap_mb = bucket_cap_mb
        self.splitter = ZeroShards(
            stage, bucket_cap_mb, tuple(elementwise_optimizers), checkpoint == "sharded"
        )
        self.splitter.bind(StrategyContext(self))

    @override
    def sync_model_states(self) -> None:
        assert self.model is not None and self.comm is not None
        if self.world_size == 1:
            return
        with torch.no_grad():
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                tree_broadcast(tensor.data, comm=self.comm, root=0)

    @override
    def configure_sync(self) -> None:
        assert self.model is not None
        self.splitter.configure(self.model, self.trace)

    @override
    def gradient_buckets(self) -> Any:
        return self.splitter

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        self.splitter.backward_started()

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        """Inside the optimizer's closure: each rank's shard of the averaged gradients is
        in place before Lightning clips them and steps."""
        self.splitter.synchronize(self.global_rank)

    # ---- sharded checkpoints (checkpoint="sharded") ----------------------------------------
    @override
    def check_before_launch(self, trainer: pl.Trainer | None) -> None:
        if is_sharded_checkpoint(self.launch_arguments.get("ckpt_path")):
            self.splitter.check_before_launch(trainer)  # a folder: read once the ranks are up
            return
        super().check_before_launch(trainer)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # a sharded checkpoint is read into the units, which setup makes
        resuming = is_sharded_checkpoint(self.launch_arguments.get("ckpt_path"))
        return resuming or super().restore_checkpoint_after_setup

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if self.checkpoint == "sharded" and self.splitter.units:
            self.splitter.save_sharded(checkpoint, filepath)
            return
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if not is_sharded_checkpoint(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._sharded_resume = checkpoint_path
        rest = read_meta(checkpoint_path)["checkpoint"]
        return {**rest, "state_dict": {}, "optimizer_states": [{} for _ in self.optimizers]}

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if self._sharded_resume is None:
            super().load_model_state_dict(checkpoint, strict=strict)
            return
        self.splitter.load_sharded(self._sharded_resume)  # weights and optimizer states

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if self._sharded_resume is None:
            super().load_optimizer_state_dict(checkpoint)
        self._sharded_resume = None  # (read with the weights)

    @override
    def on_train_end(self) -> None:
        with self.splitter.whole():  # a fork launch carries the whole model back
            super().on_train_end()

    @override
    def teardown(self) -> None:
        self.splitter.close()
        super().teardown()
