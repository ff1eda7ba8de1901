"""The options of a pipeline split, checked once, where the user's arguments enter.

``gpipe``, ``layerwise`` and the rows of ``hybrid`` cut the network with a
:class:`~lightning_par.components.pipeline_split.PipelineSplit`, which takes one
:class:`PipelineOptions`. ``GPipeStrategy`` declares every option as a keyword of its own
(jsonargparse reads constructors' signatures) and passes them on with
:meth:`PipelineOptions.of`; ``LayerwiseStrategy`` declares :data:`LAYERWISE_OPTIONS` and,
without ``time_chunk`` (the wavefront's,
:class:`~lightning_par.components.wavefront_split.WavefrontSplit`), fixes the rest
(:data:`LAYERWISE`: one micro-batch, nothing re-materialised); ``HybridStrategy`` passes
those of its ``mp_kind`` (:mod:`~lightning_par.components.hybrid_kinds`).

Building the options checks every value and looks ``schedule`` up once
(:func:`~lightning_par.components.pipeline_checks.strategy_schedule`): from then on it is a
:class:`~lightning_par.pipeline.schedules.Schedule`, which the split asks what it needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from lightning_par.components import pipeline_checks as checks
from lightning_par.components.pipeline_loss import check_loss_options
from lightning_par.pipeline.schedules import GPIPE, Schedule

#: the options ``LayerwiseStrategy`` (and ``hybrid(mp_kind="layerwise")``) takes: ``time_chunk``
#: picks the wavefront (:func:`~lightning_par.components.wavefront_split.layerwise_split`)
LAYERWISE_OPTIONS = ("balance", "time_chunk", "balance_by", "module_attr", "split_points")
#: what the layer-wise split fixes: GPipe with one micro-batch and no re-materialisation
#: (the naive split of slides 003, or the wavefront with ``time_chunk``)
LAYERWISE: dict[str, Any] = {"chunks": 1, "checkpoint": "never", "schedule": GPIPE}
#: the strategy the messages name (the options are those of ``gpipe``)
PLUGIN = "gpipe"


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """Every option of a pipeline split, checked (see the module docstring).

    Fields: as :class:`~lightning_par.strategies.gpipe.GPipeStrategy`'s arguments. Once built,
    ``schedule`` is a :class:`~lightning_par.pipeline.schedules.Schedule` and ``checkpoint`` a
    mode (``None`` given: the schedule's default).
    """

    balance: list[int] | None = None
    chunks: int = 4
    checkpoint: str | None = None
    schedule: str | Schedule = "gpipe"
    module_attr: str | None = None
    loss_attr: str = "criterion"
    balance_by: str = "params"
    deferred_batch_norm: bool = False
    virtual_stages: int = 2
    split_points: list[str] | None = None
    loss_fn: Callable | None = None
    target_index: int | str = 1

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every option, in the order ``GPipeStrategy`` declares them."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def of(cls, arguments: Mapping[str, Any], **fixed: Any) -> PipelineOptions:
        """The options among a constructor's ``arguments`` (its ``locals()``), with
        ``fixed`` over them."""
        given = {name: arguments[name] for name in cls.names() if name in arguments}
        return cls(**{**given, **fixed})

    def __post_init__(self) -> None:
        check_loss_options(self.loss_fn, self.target_index)
        schedule = checks.strategy_schedule(self.schedule)
        checkpoint = schedule.default_checkpoint if self.checkpoint is None else self.checkpoint
        checks.check_settings(self.balance, self.chunks, checkpoint, self.balance_by)
        v = self.virtual_stages
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{PLUGIN}: virtual_stages must be an int >= 1, got {v!r}")
        schedule.check_checkpoint(checkpoint, PLUGIN)
        if not isinstance(self.deferred_batch_norm, bool):
            raise TypeError(
                f"deferred_batch_norm must be True or False: {self.deferred_batch_norm!r}"
            )
        checks.check_split_points(self.balance, self.split_points)
        # frozen: the schedule found and the checkpoint resolved stand in for what was given
        object.__setattr__(self, "schedule", schedule)
        object.__setattr__(self, "checkpoint", checkpoint)
        if self.split_points is not None:
            object.__setattr__(self, "split_points", list(self.split_points))
