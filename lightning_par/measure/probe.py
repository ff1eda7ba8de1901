"""What every rank of a measured run writes, and reading it back.

On every rank :class:`Probe` writes ``probe/rank<N>.json``: step start and end times
(``time.perf_counter``, the traces' clock), the training loss of each step, peak memory and
the bytes of model state the rank holds at the end (:func:`held_bytes`), in all and by kind.
Beside each step start and end it keeps three CPU clocks, which other processes on the
machine barely move: the main thread's CPU time (``time.thread_time``: the rank's compute,
as a blocked receive sleeps), the whole process's (``time.process_time``: its communication
threads too) and the machine's busy CPU time over all cores (:func:`machine_busy_s`), from
which :func:`other_load` reads how much of the cores other processes took during the run.
:func:`load_probes` reads them back and :func:`step_windows` turns one rank's times into its
steps.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from typing_extensions import override


class Probe(pl.Callback):
    """Per rank: step times, losses, peak memory and model-state bytes, written at the end."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.losses: list[float] = []
        #: per clock of :data:`CLOCKS`: its reading at each step start and end
        self.clocks: dict[str, list[float | None]] = {f"{c}_{e}": [] for c in CLOCKS
                                                      for e in ("starts", "ends")}  # fmt: skip

    def _read_clocks(self, edge: str) -> None:
        for name, clock in CLOCKS.items():
            self.clocks[f"{name}_{edge}"].append(clock())

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._read_clocks("starts")
        self.starts.append(time.perf_counter())

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.ends.append(time.perf_counter())
        self._read_clocks("ends")
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss) if loss is not None else float("nan"))

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        state = state_tensors(pl_module, trainer.optimizers)
        device = trainer.strategy.root_device
        record = {
            "rank": trainer.global_rank,
            "starts": self.starts,
            "ends": self.ends,
            "losses": self.losses,
            **self.clocks,
            "state_bytes": held_bytes(t for ts in state.values() for t in ts),
            "held_bytes": {kind: held_bytes(ts) for kind, ts in state.items()},
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "peak_device_bytes": (
                torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            ),
        }
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def machine_busy_s() -> float | None:
    """CPU seconds the cores of this machine have run processes since boot (``/proc/stat``:
    user, nice, system, and steal: the hypervisor gave that time to another machine).
    Interrupts are left out: the kernel's loopback traffic runs there and charges no process,
    and would count the run's own messages as another's load. ``None`` without
    ``/proc/stat``."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system = ticks[:3]
    steal = ticks[7] if len(ticks) > 7 else 0
    return (user + nice + system + steal) / os.sysconf("SC_CLK_TCK")


#: The CPU clocks :class:`Probe` reads at each step start and end (see the module docstring).
CLOCKS = {"cpu": time.thread_time, "process_cpu": time.process_time, "machine_busy": machine_busy_s}


def state_tensors(module: nn.Module, optimizers: Iterable[Any] = ()) -> dict[str, list]:
    """This rank's model state by kind: ``parameters`` (the module's and the optimizers':
    a sharded optimizer steps pieces of its own), their ``gradients`` and the
    ``optimizer``'s state tensors."""
    params = list(module.parameters())
    state = []
    for optimizer in optimizers:
        inner = getattr(optimizer, "optimizer", optimizer)
        params += [q for group in inner.param_groups for q in group["params"]]
        state += [v for s in inner.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor)]  # fmt: skip
    grads = [q.grad for q in params if q.grad is not None]
    return {"parameters": params, "gradients": grads, "optimizer": state}


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of storage ``tensors`` hold, every byte once. A tensor is the part of its
    storage it spans, overlapping parts counted once (views of one flat buffer, as ZeRO's
    units and their shards are); a storage freed to nothing (ZeRO stage 3's weights between
    uses) holds none. For tensors with storages of their own: the sum of ``nbytes``."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or t.numel() == 0:
            continue
        start = t.storage_offset() * t.element_size()
        spans.setdefault(storage.data_ptr(), []).append((start, start + t.nbytes))
    total = 0
    for intervals in spans.values():
        end = -1
        for a, b in sorted(intervals):
            total += max(b - max(a, end), 0)
            end = max(end, b)
    return total


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


def step_clock(probe: dict, clock: str) -> list[float] | None:
    """``clock``'s (a name of :data:`CLOCKS`) seconds in each step of :func:`step_windows`
    (start to the next start, the last step to its end); ``None`` where the probe has no
    such readings (an older probe, or no ``/proc/stat``)."""
    starts, ends = probe.get(f"{clock}_starts"), probe.get(f"{clock}_ends")
    if not starts or not ends or None in starts or None in ends:
        return None
    return [(starts[k + 1] if k + 1 < len(starts) else ends[k]) - s for k, s in enumerate(starts)]


def other_load(probes: dict[int, dict], skip: int = 0) -> float | None:
    """Cores' worth of CPU that processes other than the run's ranks used while the run's
    steps after the first ``skip`` ran: the machine's busy CPU time (rank 0's readings) less
    every rank's own process CPU time, over rank 0's wall time. ``None`` without readings."""
    first = probes.get(min(probes, default=0))
    if not first:
        return None
    busy = step_clock(first, "machine_busy")
    own = [step_clock(p, "process_cpu") for p in probes.values()]
    if busy is None or None in own or len(busy) <= skip:
        return None
    timed = len(busy) - skip
    wall = sum(b - a for a, b in step_windows(first)[skip:])
    ours = sum(sum(c[skip : skip + timed]) for c in own)  # type: ignore[index]
    return max(sum(busy[skip:]) - ours, 0.0) / wall if wall > 0 else None
