"""Layer-wise model parallelism as a Lightning strategy: consecutive layers on K devices.

The user's network ``module.<module_attr>`` (any ``nn.Module``) is cut into ``K = devices``
stages, one process and device per stage (slides 004: "a set of layers or a layer can have
a specific device"). Its purpose is memory per device, which it reports per stage
(:meth:`LayerwiseStrategy.memory_report`): each device holds about 1/K of the parameters,
gradients and optimiser state.

* Non-recurrent networks (the CNN) run as the naive split: GPipe with one micro-batch, so a
  stage waits for the one before it (slides 003: "each layer needs to wait for the output
  of the previous layer before it can do anything"). Any network is cut from its traced
  graph; a tuple/list of tensors crossing a cut (Lightning's demo ``SimpleLSTM``'s
  ``(h, c)``) travels as its tensors (:mod:`lightning_par.graphcut.nested`), and a value
  that cannot travel is refused before launch, naming it (move ``split_points``).
* With ``time_chunk`` and recurrent stages (a stacked LSTM/GRU/RNN, one element per layer),
  the sequence streams through the stages in chunks of ``time_chunk`` steps: the wavefront of
  :mod:`lightning_par.modelparallel.wavefront`.

Module contract, balance options, checkpoints (the full model on rank 0, loadable without
this strategy), validation/test/predict and traces are those of
:class:`~lightning_par.strategies.gpipe.GPipeStrategy`: both are
:class:`~lightning_par.strategies._base.ParStrategy` with a
:class:`~lightning_par.components.pipeline_split.PipelineSplit` as splitter (here with one
micro-batch and no re-materialisation; with ``time_chunk``, a
:class:`~lightning_par.components.wavefront_split.WavefrontSplit`); this class adds the
memory report.
"""

from __future__ import annotations

import json
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_par.components.wavefront_split import WavefrontSplit, layerwise_split
from lightning_par.modelparallel.memory import stage_memory
from lightning_par.output import format_bytes, say
from lightning_par.pipeline.state import gather_objects
from lightning_par.strategies._base import ParStrategy
from lightning_par.strategies._split_context import StrategyContext


class LayerwiseStrategy(ParStrategy):
    """Consecutive layers on different devices; the stacked-RNN wavefront with ``time_chunk``.

    Args:
        balance: layers per stage (``len(balance)`` = number of devices); ``None`` balances
            by ``balance_by`` (with ``time_chunk``: the recurrent layers by parameters).
        time_chunk: time steps per message for recurrent stages (``1``: the slides' picture,
            one step at a time); ``None``: the naive split, the whole batch at once.
        balance_by: ``"params"`` or ``"time"`` (see :class:`GPipeStrategy`).
        module_attr: the LightningModule's attribute holding the network (``None``: ``net``,
            or its only child module with parameters).
        split_points: module names to cut before (``K - 1`` of them), for any network; see
            :class:`~lightning_par.strategies.gpipe.GPipeStrategy`.
        **kwargs: ``trace``, ``trace_dir`` (per-rank traces and ``memory.json``),
            ``start_method``, ``process_group_backend``, ``timeout``.
    """

    strategy_name = "layerwise"
    shards_data = False

    def __init__(
        self,
        balance: list[int] | None = None,
        time_chunk: int | None = None,
        balance_by: str = "params",
        module_attr: str | None = None,
        split_points: list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        split = layerwise_split(balance, time_chunk, balance_by, module_attr, split_points)
        super().__init__(**kwargs)
        self.splitter = split
        split.bind(StrategyContext(self))
        self.memory: list[dict[str, int]] | None = None  # per stage, on rank 0

    @property
    def time_chunk(self) -> int | None:
        """Time steps per message of the wavefront; ``None``: the naive split."""
        split = self.splitter
        return split.time_chunk if isinstance(split, WavefrontSplit) else None

    @override
    def prepare_model(self, trainer: pl.Trainer) -> None:
        super().prepare_model(trainer)
        self.splitter.held[1].measure_memory()

    # ---- memory per stage ----------------------------------------------------------------
    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.memory is None:  # once, after the first step: gradients and state exist
            self.memory_report(optimizer)
        return out

    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> list | None:
        """Every stage's ``param_bytes``, ``grad_bytes``, ``optimizer_bytes`` and peak
        ``activation_bytes`` (saved for backward in the last step), gathered on rank 0 (logged,
        and saved as ``memory.json`` in ``trace_dir``); ``None`` on other ranks. Every rank
        must call it."""
        piped, runtime = self.splitter.held
        saved = runtime.saved
        mine = stage_memory(piped, optimizer, saved.nbytes if saved is not None else None)
        mine["stage"] = self.split_comm.rank
        stages = gather_objects(self.split_comm, mine, self.root_device)
        if stages is None:
            self.memory = []
            return None
        self.memory = stages
        size = format_bytes
        lines = [f"stage {m['stage']}: params {size(m['param_bytes'])}, grads "
                 f"{size(m['grad_bytes'])}, optimiser {size(m['optimizer_bytes'])}, "
                 f"activations {size(m['activation_bytes'])}" for m in stages]  # fmt: skip
        trainer = getattr(self.lightning_module, "_trainer", None)
        say(trainer, "layerwise memory per stage:\n  " + "\n  ".join(lines))
        if self.trace_dir is not None and self.global_rank == 0:
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            (self.trace_dir / "memory.json").write_text(json.dumps(stages))
        return stages
