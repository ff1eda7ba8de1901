"""One result row from a finished run's probes and traces (see :mod:`lightning_par.compare.run`)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from lightning_par.comm.trace import CommTrace, load_traces
from lightning_par.compare.breakdown import bytes_sent_in, split_steps


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


def analyse(folder: Path, warmup: int, global_batch: int) -> dict[str, Any]:
    """Times, bytes, memory and loss of one strategy's run (per step, after ``warmup``)."""
    probes = load_probes(folder)
    if not probes:
        raise RuntimeError(f"no rank wrote its probe in {folder}")
    traces: dict[int, CommTrace] = {}
    if (folder / "trace").is_dir():
        traces = {t.rank: t for t in load_traces(folder / "trace")}
    windows = {r: step_windows(p)[warmup:] for r, p in probes.items()}
    timed = min(len(w) for w in windows.values())
    if timed < 1:
        raise RuntimeError(f"only {warmup} steps or fewer ran: nothing left to time")
    windows = {r: w[:timed] for r, w in windows.items()}
    if not any(t.messages for t in traces.values()):
        traces = {}  # e.g. torch DDP: its allreduce bypasses the traced communicator
    parts = split_steps(traces, windows)
    ranks = sorted(probes)
    step_s = statistics.fmean(sum(b - a for a, b in windows[r]) / timed for r in ranks)

    def mean(key: str) -> float | None:
        return statistics.fmean(parts[r][key] for r in ranks) if traces else None

    sent = [bytes_sent_in(traces.get(r), windows[r]) for r in ranks]
    last_losses = [probes[r]["losses"][-1] for r in ranks if probes[r]["losses"]]
    device_peaks = [probes[r]["peak_device_bytes"] for r in ranks]
    return {
        "ranks": len(ranks),
        "steps_timed": timed,
        "step_s": step_s,
        "images_per_s": global_batch / step_s,
        "compute_s": mean("compute"),
        "communication_s": mean("communication"),
        "waiting_s": mean("waiting"),
        "overlapped_s": mean("overlapped"),
        "traced": bool(traces),
        "bytes_sent_per_rank": [None if b is None else b / timed for b in sent],
        "state_bytes_per_rank": [probes[r]["state_bytes"] for r in ranks],
        "peak_rss_bytes_per_rank": [probes[r]["peak_rss_bytes"] for r in ranks],
        "peak_device_bytes_per_rank": None if None in device_peaks else device_peaks,
        "final_loss": statistics.fmean(last_losses) if last_losses else None,
        "loss_curve": _mean_curve([probes[r]["losses"] for r in ranks]),
    }


def _mean_curve(curves: list[list[float]]) -> list[float]:
    """The loss of each step averaged over ranks (data-parallel ranks see different shards:
    their mean is the loss of the whole global batch)."""
    n = min(len(c) for c in curves)
    return [statistics.fmean(c[k] for c in curves) for k in range(n)]
