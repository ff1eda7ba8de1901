"""Replay a finished run: its traces, the measured step, the simulated one.

A *run folder* is what :mod:`lightning_par.compare` keeps per strategy under
``runs/compare/runs/<strategy>/``: ``probe/rank<N>.json`` (step start and end times on the
traces' clock), ``trace/rank<N>.json`` (:func:`~lightning_par.comm.trace.save_trace`) and
``row.json`` (strategy, devices, global batch, warm-up steps). A folder of traces alone (any
plugin's ``trace_dir=``) replays too: its interval is then the whole trace, one "step".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from lightning_par.comm.trace import CommTrace, load_traces
from lightning_par.measure.probe import load_probes, other_load, step_clock, step_windows
from lightning_par.simulate.engine import Result, simulate
from lightning_par.simulate.graph import build_graph, transfer_samples
from lightning_par.simulate.links import Link, Topology, fit_link
from lightning_par.simulate.ops import Graph


@dataclass
class Run:
    """One run's traces and step windows (absolute ``perf_counter`` intervals per rank)."""

    name: str
    traces: list[CommTrace]
    windows: dict[int, list[tuple[float, float]]] | None
    row: dict = field(default_factory=dict)
    #: each rank's probe (:class:`~lightning_par.measure.probe.Probe`), where the run has them
    probes: dict[int, dict] = field(default_factory=dict)
    #: warm-up steps left out before ``windows``
    skipped: int = 0

    @property
    def measured_step_s(self) -> float | None:
        if not self.windows:
            return None
        per_rank = [sum(b - a for a, b in w) / len(w) for w in self.windows.values()]
        return sum(per_rank) / len(per_rank)

    def clock_per_step(self, clock: str) -> dict[int, float] | None:
        """Per rank, the probe's ``clock`` (``cpu``, ``process_cpu``: see
        :data:`~lightning_par.measure.probe.CLOCKS`) in seconds per step of ``windows``;
        ``None`` where a probe has no such readings (a run recorded before them)."""
        if not self.windows or not self.probes:
            return None
        out = {}
        for rank, probe in self.probes.items():
            seconds = step_clock(probe, clock)
            timed = len(self.windows.get(rank, []))
            if seconds is None or len(seconds) < self.skipped + timed or not timed:
                return None
            out[rank] = sum(seconds[self.skipped : self.skipped + timed]) / timed
        return out

    @property
    def other_load(self) -> float | None:
        """Cores' worth of CPU other processes took while the timed steps ran
        (:func:`~lightning_par.measure.probe.other_load`); ``None`` without readings."""
        return other_load(self.probes, self.skipped) if self.windows else None

    @property
    def world(self) -> int:
        return len(self.traces)

    def loopback(self) -> Link:
        """This run's links, fitted to its own traced transfers."""
        samples = transfer_samples(self.traces)
        if not samples:
            raise ValueError(f"{self.name}: no matched messages to fit the loopback link on")
        return fit_link(samples)

    def graph(self, link: Link | None = None) -> Graph:
        return build_graph(self.traces, link or self.loopback(), self.windows)


def load_run(folder: str | Path, warmup: int | None = None) -> Run:
    """A run folder (see the module docstring), or a folder of ``rank<N>.json`` traces."""
    folder = Path(folder)
    trace_dir = folder / "trace" if (folder / "trace").is_dir() else folder
    traces = load_traces(trace_dir)
    if not traces:
        raise ValueError(
            f"no traces (rank<N>.json) in {trace_dir}: a lightning_par strategy "
            "saves them when given trace_dir=, e.g. Trainer(strategy="
            "AllReduceStrategy(algorithm='ring', trace_dir='traces')); "
            "python -m lightning_par.compare keeps them in runs/<strategy>/trace/"
        )
    row = json.loads((folder / "row.json").read_text()) if (folder / "row.json").exists() else {}
    windows, skip = None, 0
    probes = load_probes(folder) if (folder / "probe").is_dir() else {}
    if probes:
        skip = warmup if warmup is not None else int(row.get("warmup", 0))
        windows = {r: step_windows(p)[skip:] for r, p in probes.items()}
        timed = min(len(w) for w in windows.values())
        if timed < 1:
            raise ValueError(f"{folder}: no step left after {skip} warm-up steps")
        windows = {r: w[:timed] for r, w in windows.items()}
    return Run(row.get("strategy", folder.name), traces, windows, row, probes, skip)


def replay(
    run: Run, topo: Topology | None = None, speed: float | dict[int, float] = 1.0,
    contention: bool = False, link: Link | None = None,
) -> Result:  # fmt: skip
    """Simulate ``run`` on ``topo`` (default: everywhere ``link``, the link the run had:
    by default fitted to its own transfers)."""
    own = link or run.loopback()
    topo = topo or Topology(own, own)
    return simulate(build_graph(run.traces, own, run.windows), topo, speed, contention)
