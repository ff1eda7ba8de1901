"""Layer-wise model parallelism as a Lightning strategy: consecutive layers on K devices.

The network ``module.<module_attr>`` (an ``nn.Sequential``) is cut into ``K = devices``
stages, one process and device per stage (slides 004: "a set of layers or a layer can have
a specific device"). Its purpose is memory per device, which it reports per stage
(:meth:`LayerwiseStrategy.memory_report`): each device holds about 1/K of the parameters,
gradients and optimiser state.

* Non-recurrent networks (the CNN) run as the naive split: GPipe with one micro-batch, so a
  stage waits for the one before it (slides 003: "each layer needs to wait for the output
  of the previous layer before it can do anything").
* With ``time_chunk`` and recurrent stages (a stacked LSTM/GRU/RNN, one element per layer),
  the sequence streams through the stages in chunks of ``time_chunk`` steps: the wavefront of
  :mod:`lightning_par.modelparallel.wavefront`.

Module contract, balance options, checkpoints (the full model on rank 0, loadable without
this strategy), validation/test/predict and traces are those of
:class:`~lightning_par.strategies.gpipe.GPipeStrategy`, which this class specialises.
"""

from __future__ import annotations

import json
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_par.modelparallel.memory import stage_memory
from lightning_par.modelparallel.wavefront import (
    WavefrontSequential,
    recurrent_parts,
    wavefront_balance,
)
from lightning_par.output import format_bytes, say
from lightning_par.pipeline.partition import split_sequential
from lightning_par.pipeline.state import gather_objects, send_weights_from_first
from lightning_par.strategies.gpipe import GPipeStrategy


class LayerwiseStrategy(GPipeStrategy):
    """Consecutive layers on different devices; the stacked-RNN wavefront with ``time_chunk``.

    Args:
        balance: layers per stage (``len(balance)`` = number of devices); ``None`` balances
            by ``balance_by`` (with ``time_chunk``: the recurrent layers by parameters).
        time_chunk: time steps per message for recurrent stages (``1``: the slides' picture,
            one step at a time); ``None``: the naive split, the whole batch at once.
        balance_by: ``"params"`` or ``"time"`` (see :class:`GPipeStrategy`).
        module_attr: name of the ``nn.Sequential`` attribute of the LightningModule.
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
        module_attr: str = "net",
        **kwargs: Any,
    ) -> None:
        if time_chunk is not None and (not isinstance(time_chunk, int) or time_chunk < 1):
            raise ValueError(f"time_chunk must be an int >= 1 or None, got {time_chunk!r}")
        super().__init__(balance=balance, chunks=1, checkpoint="never", schedule="gpipe",
                         module_attr=module_attr, balance_by=balance_by, **kwargs)  # fmt: skip
        self.time_chunk = time_chunk
        self.memory: list[dict[str, int]] | None = None  # per stage, on rank 0

    @property
    def pipelined(self) -> nn.Module:
        return getattr(self.lightning_module, self.module_attr)

    def check_before_launch(self, trainer: pl.Trainer | None = None) -> None:
        net = getattr(self.lightning_module, self.module_attr, None)
        if isinstance(net, WavefrontSequential):
            return
        super().check_before_launch(trainer)
        if self.time_chunk is not None and isinstance(net, nn.Sequential):
            recurrent_parts(net, self.balance or wavefront_balance(net, self.num_stages))

    def _split_network(self) -> None:
        net = getattr(self.lightning_module, self.module_attr, None)
        if self.time_chunk is None:
            super()._split_network()
        elif not isinstance(net, WavefrontSequential):
            self.check_before_launch(self.lightning_module.trainer)
            balance = self.balance or wavefront_balance(net, self.num_stages)
            stages = split_sequential(net, balance)
            piped = WavefrontSequential(net, balance, self.stage_comm, self.time_chunk)
            piped.to(self.root_device)
            first = [s.state_dict() for s in stages] if self.stage_comm.rank == 0 else None
            send_weights_from_first(self.stage_comm, first, piped.state_dict(), self.root_device)
            setattr(self.lightning_module, self.module_attr, piped)
        self.pipelined.runtime.measure_memory()

    # ---- memory per stage ----------------------------------------------------------------
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
        piped = self.pipelined
        saved = piped.runtime.saved
        mine = stage_memory(piped, optimizer, saved.nbytes if saved is not None else None)
        mine["stage"] = self.stage_comm.rank
        stages = gather_objects(self.stage_comm, mine, self.root_device)
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
