"""The ZeRO component: the model's parameters in flat units, the optimizer stepping this
rank's shard of them, and what each stage keeps whole (:mod:`lightning_par.zero`).

:class:`ZeroShards` is a :class:`~lightning_par.components.splitter.ModelSplitter` because
it answers the same hooks a split model does: around each step (stage 3 gathers the
units), after backward (the gradient shards), after the optimizer step (stages 1-2
all-gather the new weights), and for checkpoints, which it writes in one process's format
(the units gathered, the optimizer state all-gathered) and reads from it (each rank keeps
its slice), so a checkpoint loads into any other plugin or one process.

* stage 1: gradients averaged by the ring allreduce in buckets during backward (as
  ``ring_allreduce``: the same sums, bit for bit), each rank steps its shard of every
  parameter, the new shards are all-gathered;
* stage 2: gradients reduce-scattered unit by unit during backward, each rank keeping only
  its shard's; the new shards all-gathered after the step;
* stage 3: parameters sharded at rest, each unit gathered around the layer that uses it
  (:class:`~lightning_par.zero.gather.StageThree`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_par.collectives import ring_all_gather, ring_allreduce
from lightning_par.comm import CommTrace
from lightning_par.components.grad_sync import GradientSync
from lightning_par.components.pipeline_features import (
    clip_by_whole_model,
    clip_grad_norm_across_stages,
)
from lightning_par.components.splitter import ModelSplitter
from lightning_par.zero.gather import StageThree
from lightning_par.zero.grads import ShardedGradients
from lightning_par.zero.optimizer import ShardedOptimizer, check_elementwise
from lightning_par.zero.sharded_checkpoint import (
    CONSOLIDATE,
    check_resumable,
    load_sharded,
    read_meta,
    save_sharded,
)
from lightning_par.zero.units import FlatUnit, unit_parameters


class ZeroShards(ModelSplitter):
    """ZeRO ``stage`` (1, 2 or 3) over the splitter's communicator.

    Args:
        stage: what is sharded: 1 optimizer state, 2 and gradients, 3 and parameters.
        bucket_cap_mb: the largest unit of stages 1-2 (stage 3: one unit per layer).
        elementwise_optimizers: optimizer classes, besides torch's element-wise ones, whose
            update is element-wise.
        sharded_checkpoints: checkpoints keep each rank's shards (``zero(checkpoint=
            "sharded")``) instead of gathering one process's.
    """

    def __init__(
        self,
        stage: int,
        bucket_cap_mb: float,
        elementwise_optimizers: tuple = (),
        sharded_checkpoints: bool = False,
    ) -> None:
        super().__init__()
        self.stage, self.bucket_cap_mb = stage, bucket_cap_mb
        #: checkpoints keep each rank's shards (nothing gathered) unless :meth:`whole` says
        self.sharded_checkpoints = sharded_checkpoints
        self._whole_checkpoint = False
        self.elementwise_optimizers = tuple(elementwise_optimizers)
        self.units: list[FlatUnit] = []
        self.sharded: dict[int, ShardedOptimizer] = {}
        self.grad_sync: GradientSync | None = None
        self.grads: ShardedGradients | None = None
        self.stage3: StageThree | None = None
        self._executor: ThreadPoolExecutor | None = None
        self.trace: CommTrace | None = None
        self._backward_start: tuple[float, float] | None = None  # CommTrace.mark()

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"zero (stage {self.stage})"

    # ---- setting up, when fitting ----------------------------------------------------------
    def configure(self, model: nn.Module, trace: CommTrace | None) -> None:
        """Lay the parameters out in units and hook their gradients (``configure_sync``)."""
        self.close()
        comm, self.trace = self.comm, trace
        p, rank = comm.world_size, comm.rank
        groups = unit_parameters(model, self.stage, self.bucket_cap_mb)
        self.units = [FlatUnit(i, g, p, rank) for i, g in enumerate(groups) if g]
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="lightning_par-zero")
        if self.stage == 1:
            self.grad_sync = GradientSync(ring_allreduce, self.bucket_cap_mb)
            self.grad_sync.attach(model, comm, trace)
            return
        if self.stage == 3:
            self.stage3 = StageThree(model, self.units, comm, self._executor, trace)
        order = self.units if self.stage == 2 else list(reversed(self.units))
        self.grads = ShardedGradients(
            order, comm, self._executor, self._shard_done,
            packed=self.stage3.packed if self.stage3 is not None else (lambda unit: None),
            trace=trace,
        )  # fmt: skip

    def after_setup(self, trainer: pl.Trainer) -> None:
        if not self.units:
            return
        self.sharded = {}
        for optimizer in trainer.strategy.optimizers:
            check_elementwise(optimizer, self.context.name, self.elementwise_optimizers)
            self.sharded[id(optimizer)] = ShardedOptimizer(optimizer, self.units)
        clip_by_whole_model(self.context.precision, self._clip)

    def _clip(self, optimizer: Any, clip_val: float) -> None:
        """Clipping by norm: the norm of every rank's pieces together (they tile the model)."""
        pieces = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grad_norm_across_stages(pieces, clip_val, group=self.comm.group)

    # ---- steps -----------------------------------------------------------------------------
    @contextmanager
    def running(self) -> Iterator[None]:
        if self.stage3 is None:
            yield
            return
        training = torch.is_grad_enabled() and self.module.training
        with self.stage3.step(training):
            yield

    def no_sync(self):
        """Gradient accumulation: no communication on the accumulating micro-steps."""
        if self.grad_sync is not None:
            return self.grad_sync.no_sync()
        return self.grads.no_sync() if self.grads is not None else nullcontext()

    def backward_started(self) -> None:
        if self.grad_sync is not None:
            self.grad_sync.backward_started()
        elif self.trace is not None:
            self._backward_start = self.trace.mark()

    def synchronize(self, rank: int) -> None:
        """After backward (inside the optimizer's closure, before clipping): every rank's
        pieces get their averaged gradients."""
        self._refuse_new_groups()
        if self.grad_sync is not None:
            buckets = self.grad_sync.buckets  # None with one process: nothing to average
            if buckets is not None and not buckets.enabled:
                return  # accumulating
            if buckets is not None:
                self.grad_sync.finish(rank)
            for sharded in self.sharded.values():
                sharded.set_gradients_from_parameters()
            return
        if self.grads is None or not self.grads.enabled:
            return
        self._refuse_late_parameters()
        if self.trace is None:
            self.grads.synchronize()
        else:  # the spans the compare's step split and the simulator read
            if self._backward_start is not None:
                self.trace.close("backward", self._backward_start)
                self._backward_start = None
            with self.trace.span("wait for reduce-scatters"):
                self.grads.synchronize()
        if self.stage3 is not None:
            self.stage3.after_backward()

    def _shard_done(self, unit: FlatUnit, grads: torch.Tensor, used: list[bool]) -> None:
        for sharded in self.sharded.values():
            sharded.set_gradients(unit, grads, used)

    def _refuse_new_groups(self) -> None:
        for sharded in self.sharded.values():
            if len(sharded.optimizer.param_groups) != len(sharded.original):
                raise RuntimeError(
                    f"{self.context.name}: a parameter group was added to the optimizer after "
                    "setup (BackboneFinetuning's pattern); its parameters have no shard. Give "
                    "every group to configure_optimizers (frozen parameters may be in it), or "
                    "use ring_allreduce"
                )

    def _refuse_late_parameters(self) -> None:
        late = [
            p for p in self.module.parameters() if p.grad is not None and not self.grads.known(p)
        ]
        if late:
            raise RuntimeError(
                f"{self.context.name}: {len(late)} parameter(s) became trainable after setup "
                "(a fine-tuning callback?); their gradients have no shard. Make them "
                "trainable before fit, or use stage=1 or ring_allreduce, which average whole "
                "gradients"
            )

    def after_optimizer_step(self, optimizer: Any) -> None:
        if not self.units or self.stage == 3:
            return
        with torch.no_grad():
            for unit in self.units:
                if any(q.requires_grad for q in unit.params):
                    ring_all_gather(unit.full, comm=self.comm)
        if self.stage == 1:
            for q in self.module.parameters():
                q.grad = None  # the pieces stepped; whole gradients start afresh

    # ---- checkpoints in one process's format -------------------------------------------------
    @contextmanager
    def whole(self) -> Iterator[None]:
        """Checkpoints made inside gather the whole model (the fork launch's carry-back)."""
        previous, self._whole_checkpoint = self._whole_checkpoint, True
        try:
            yield
        finally:
            self._whole_checkpoint = previous

    @property
    def gathers_checkpoints(self) -> bool:
        return not self.sharded_checkpoints or self._whole_checkpoint

    def full_state_dict(self, local: dict[str, Any]) -> dict[str, Any]:
        if self.stage3 is None or not self.gathers_checkpoints:
            return local
        values: dict[int, torch.Tensor] = {}
        for unit in self.units:
            self.stage3.gather(unit)
            values.update({id(q): q.detach().clone() for q in unit.params})
            if unit not in self.stage3.resident:
                self.stage3.free(unit)
        whole = dict(local)
        for name, q in self.module.named_parameters(remove_duplicate=False):
            if name in whole and id(q) in values:
                whole[name] = values[id(q)]
        return whole

    def full_optimizer_state(self, local: dict[str, Any], optimizer: Any) -> dict[str, Any]:
        sharded = self.sharded.get(id(getattr(optimizer, "_optimizer", optimizer)))
        if sharded is None or not self.gathers_checkpoints:
            return local
        return sharded.full_state_dict(self.comm)

    def load_optimizer_states(self, optimizers: list[Any], states: list[Any]) -> bool:
        if not self.sharded:
            return False
        for optimizer, state in zip(optimizers, states):
            self.sharded[id(getattr(optimizer, "_optimizer", optimizer))].load_full_state_dict(
                state
            )
        return True

    def save_sharded(self, checkpoint: dict[str, Any], path: Any) -> None:
        """Every rank writes its shards into the folder ``path`` (nothing gathered)."""
        save_sharded(path, checkpoint, self.units, list(self.sharded.values()), self.module,
                     self.comm)  # fmt: skip

    def load_sharded(self, path: Any) -> None:
        """Every rank reads its shards of the weights and optimizer states from ``path``."""
        if not self.units:
            raise ValueError(
                f"{self.context.name}: a sharded checkpoint resumes a fit of zero; to "
                f"validate, test, predict or use it elsewhere, {CONSOLIDATE.format(path=path)} "
                "and pass whole.ckpt"
            )
        check_resumable(read_meta(path), self.units, self.module, self.comm.world_size, path)
        buffers = load_sharded(path, self.units, list(self.sharded.values()), self.module,
                               self.comm)  # fmt: skip
        with torch.no_grad():
            for name, value in self.module.named_buffers():
                value.copy_(buffers[name])
            if self.stage != 3:
                for unit in self.units:
                    ring_all_gather(unit.full, comm=self.comm)

    # ---- the end of a fit -------------------------------------------------------------------
    def close(self) -> None:
        """Give the model its whole weights and the optimizer its whole parameters and state
        back (every rank: the shards are gathered), and remove every hook."""
        failing = sys.exc_info()[0] is not None  # a peer may be gone: no collective then
        if self.grad_sync is not None:
            self.grad_sync.close()
        if self.grads is not None:
            self.grads.close()
        if self.stage3 is not None and not failing:
            self.stage3.close()
        for sharded in self.sharded.values():
            if not failing:
                sharded.restore(self.comm)
        for unit in self.units:
            if unit.gathered:
                unit.restore_whole()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self.units, self.sharded = [], {}
        self.grad_sync = self.grads = self.stage3 = None
        self._executor = None
