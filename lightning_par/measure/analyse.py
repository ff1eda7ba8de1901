"""What a finished run's probes and traces say: step times, their split, bytes, memory, loss
(the run: :mod:`lightning_par.measure.run`)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from lightning_par.comm.trace import CommTrace, load_traces
from lightning_par.measure.breakdown import bytes_sent_in, split_steps
from lightning_par.measure.probe import load_probes, step_windows


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
