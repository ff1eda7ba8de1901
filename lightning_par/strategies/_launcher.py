"""Fork/spawn launcher for strategies that split the model: hand the FULL model back.

Lightning's multiprocessing launcher returns ``lightning_module.state_dict()`` of rank 0 to
the main process, which for a split model holds only stage 0 (and is loaded non-strictly,
silently). This launcher returns ``strategy.lightning_module_state_dict()`` instead, which
the pipeline strategy gathers from every stage (a collective: every rank calls it).
It also runs the strategy's ``check_before_launch()`` in the main process.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _MultiProcessingLauncher,
    _WorkerOutput,
)
from lightning.pytorch.trainer.states import TrainerFn


class FullStateLauncher(_MultiProcessingLauncher):
    def launch(self, function, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        check = getattr(self._strategy, "check_before_launch", None)
        if check is not None:
            check(
                trainer
            )  # bad configurations fail here, in the main process, with their own error
        return super().launch(function, *args, trainer=trainer, **kwargs)

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback else None
        state_dict = self._strategy.lightning_module_state_dict()  # every rank takes part
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        extra = self.get_extra_results(trainer)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, extra)
