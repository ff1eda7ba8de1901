"""What the two splitters that put a network's stages on consecutive ranks share:
:class:`~lightning_par.components.pipeline_split.PipelineSplit` (any network, micro-batched
by a schedule) and :class:`~lightning_par.components.wavefront_split.WavefrontSplit` (an
RNN's layers, the sequence streamed through them).

Both hold their stage in the network's place, turn it on while a step runs, check once that
every rank reads the same batch, clip by the norm of every stage's gradients together, refuse an
optimiser that reads the whole model (LBFGS: :mod:`.split_optimizers`), and explain an
optimiser left without parameters on a rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn

from lightning_par.components import pipeline_features as features
from lightning_par.components.split_optimizers import WHOLE_MODEL, refuse_optimizers
from lightning_par.components.splitter import ModelSplitter, find_network


class StageSplit(ModelSplitter):
    """A splitter whose ranks each hold consecutive stages of one network (see the module
    docstring). A subclass says what is running (:meth:`running_part`) and which parameters
    its stages count in the norm (:meth:`clipped_parameters`)."""

    module_attr: str | None = None
    batch_checked = False

    @property
    def attr(self) -> str:
        """The LightningModule's attribute holding the network (``module_attr``, or found)."""
        return find_network(self.module, self.module_attr, self.name)

    def running_part(self) -> Any:
        """The object whose ``active`` flag turns this rank's stages on."""
        raise NotImplementedError

    def clipped_parameters(self) -> tuple[set[int], set[int]]:
        """(ids of the parameters this rank's stages count in the norm, ids of every
        parameter of the network: any other is outside it, counted once on rank 0)."""
        raise NotImplementedError

    def after_setup(self, trainer: pl.Trainer) -> None:
        self.batch_checked = False
        if trainer.state.fn == TrainerFn.FITTING:
            holds = "the parameters of its own stages"
            refuse_optimizers(trainer.optimizers, self.name, holds, WHOLE_MODEL)
            features.clip_by_whole_model(self.context.precision, self._clip_by_whole_norm)

    def explain_optimizer_error(self, error: ValueError) -> ValueError | None:
        return features.empty_optimizer_error(self.name, self.context.rank, error)

    def _clip_by_whole_norm(self, optimizer: Any, clip_val: float) -> None:
        """Lightning's clipping by norm, by the norm of every stage's gradients together."""
        params = list(self.context.precision.main_params(optimizer))
        counted, network = self.clipped_parameters()
        features.clip_grad_norm_across_stages(
            [p for p in params if id(p) in counted], clip_val,
            shared_params=[p for p in params if id(p) not in network],
            count_shared=self.comm.rank == 0, group=self.comm.group,
        )  # fmt: skip

    def check_batch_once(self, batch: Any) -> None:
        """Every rank of the split reads the same batch (checked on the first step)."""
        if not self.batch_checked and self.size > 1:
            features.check_same_batch(
                batch, self.comm.rank, self.size, self.name, group=self.comm.group
            )
            self.batch_checked = True

    @contextmanager
    def running(self) -> Iterator[None]:
        part = self.running_part()
        part.active = True  # every stage runs forward now
        try:
            yield
        finally:
            part.active = False
