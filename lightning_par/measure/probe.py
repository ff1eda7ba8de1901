"""What every rank of a measured run writes, and reading it back.

On every rank :class:`Probe` writes ``probe/rank<N>.json``: step start and end times
(``time.perf_counter``, the traces' clock), the training loss of each step, peak memory and
the bytes of model state the rank holds. :func:`load_probes` reads them back and
:func:`step_windows` turns one rank's times into its steps.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_par.modelparallel.memory import stage_memory


class Probe(pl.Callback):
    """Per rank: step times, losses, peak memory and model-state bytes, written at the end."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.losses: list[float] = []

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.ends.append(time.perf_counter())
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss) if loss is not None else float("nan"))

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        state = stage_memory(pl_module, optimizer)
        device = trainer.strategy.root_device
        record = {
            "rank": trainer.global_rank,
            "starts": self.starts,
            "ends": self.ends,
            "losses": self.losses,
            "state_bytes": state["param_bytes"] + state["grad_bytes"] + state["optimizer_bytes"],
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "peak_device_bytes": (
                torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            ),
        }
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def load_probes(folder: Path) -> dict[int, dict]:
    probes = {}
    for path in (folder / "probe").glob("rank*.json"):
        record = json.loads(path.read_text())
        probes[record["rank"]] = record
    return probes


def step_windows(probe: dict) -> list[tuple[float, float]]:
    """Step ``k`` runs from its start to the next step's start (loading that batch included);
    the last step ends where it ended."""
    starts, ends = probe["starts"], probe["ends"]
    return [(s, starts[k + 1] if k + 1 < len(starts) else ends[k]) for k, s in enumerate(starts)]
