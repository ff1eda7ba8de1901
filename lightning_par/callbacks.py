"""Callbacks for teaching and benchmarks: :class:`Straggler` makes one rank k times slower.

Synchronous data parallelism is only as fast as its slowest worker (course material 004:
the synchronous approach "has to wait for completing all the processes"). To show this on
one machine whose ranks are all alike, :class:`Straggler` slows one rank down by
*sleeping*: after each training batch it sleeps ``(slowdown - 1)`` times that batch's
measured time, so the rank takes ``slowdown`` times as long per batch while its CPU is
free for the others (a busy loop would also slow its neighbours on a shared machine).
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override


class Straggler(pl.Callback):
    """Make rank ``rank`` ``slowdown`` times slower per training batch, by sleeping.

    The batch time is the wall time from ``on_train_batch_start`` to ``on_train_batch_end``
    on that rank: forward, backward, optimiser step and any communication inside the step
    (data loading happens before and is not stretched). Sleeping ``(slowdown - 1)`` times
    it afterwards stretches the rank's step to ``slowdown`` times its own length, whatever
    the model, batch size or machine load, and costs no CPU time.

    Args:
        rank: the global rank to slow down (must exist in the run).
        slowdown: ``k >= 1``: how many times longer the rank's batches take (1: no change).

    Attributes:
        batches: batches slowed down on this rank so far.
        measured_s: their total measured time before sleeping.
        slept_s: the total time slept.
    """

    def __init__(self, rank: int = 1, slowdown: float = 3.0) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"Straggler rank must be a rank number >= 0, got {rank!r}")
        if isinstance(slowdown, bool) or not isinstance(slowdown, (int, float)):
            raise TypeError(f"Straggler slowdown must be a number >= 1, got {slowdown!r}")
        if not slowdown >= 1:
            raise ValueError(
                f"Straggler slowdown must be >= 1 (k times slower; 1 = unchanged), got {slowdown}"
            )
        self.rank = rank
        self.slowdown = float(slowdown)
        self.batches = 0
        self.measured_s = 0.0
        self.slept_s = 0.0
        self._start: float | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.rank >= trainer.world_size:
            raise ValueError(
                f"Straggler(rank={self.rank}) but the run has {trainer.world_size} rank(s) "
                f"(0..{trainer.world_size - 1})"
            )

    def _active(self, trainer: pl.Trainer) -> bool:
        return trainer.global_rank == self.rank and self.slowdown > 1

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._active(trainer):
            self._start = time.perf_counter()

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not self._active(trainer) or self._start is None:
            return
        measured = time.perf_counter() - self._start
        pause = (self.slowdown - 1.0) * measured
        time.sleep(pause)
        self.batches += 1
        self.measured_s += measured
        self.slept_s += pause
        self._start = None
