"""What a 2-core machine cannot show: a notebook's own run replayed on other hardware.

Two ways, both the simulator's (:mod:`lightning_par.simulate`):

* :func:`replay_steps` replays each timed step of a run from its traces, message by message:
  on this machine's link fitted to the run's own messages (a check of the model against the
  measured step), then on the two machines below, each rank computing as fast as its CPU
  time in the step allows (no wait for a core);
* :func:`speedups` gives a run's profile (:mod:`lightning_par.simulate.profile`, from its
probes and traces) to the simulator's scale-out (:func:`lightning_par.simulate.scale.predict_step`)
on the two machines the course names, at the run's own global batch (strong scaling):

* **a 16-core CPU**: this machine's cores and link (the loopback fitted to the run's own
  transfers, or the simulator's loopback preset), one core and one thread per process;
* **8 GPUs over NVLink 4**: the simulator's ``nvlink`` preset (NVIDIA's H100 SXM
  datasheet), compute run :data:`~lightning_par.compare.predicted.SPEEDUP` times faster
  than here (the compare report's stand-in for a GPU).

Every number it returns is a prediction of the simulator's model, not a measurement.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from statistics import fmean
from typing import Literal, NamedTuple

from lightning_par.comm import CommTrace
from lightning_par.compare.predicted import SPEEDUP
from lightning_par.simulate import Run, replay
from lightning_par.simulate.base import compute_per_step
from lightning_par.simulate.links import PRESETS, Link, Topology, parse_topology
from lightning_par.simulate.profile import Profile
from lightning_par.simulate.scale import predict_step

CPU_CORES = 16
GPUS = 8
#: :func:`replay_steps`'s figures: the step as measured, replayed on this machine, predicted
#: on a 16-core CPU and on one 8-GPU NVLink node.
HARDWARE = ("measured", "replayed here", f"{CPU_CORES}-core CPU", f"{GPUS} GPUs, NVLink")
NVLINK_NODE = Topology(PRESETS["nvlink"], PRESETS["nvlink"], per_node=GPUS)


def replay_steps(traces: Sequence[CommTrace], steps: Iterable[int],
                 cpu_from: Literal["spans", "step"] = "spans") -> dict[str, float]:  # fmt: skip
    """Each of ``steps`` (every rank's ``"step"`` span of that number) measured, replayed and
    predicted (:data:`HARDWARE`); the means over ``steps``, in seconds.

    On the 16-core CPU each rank has a core of its own: it computes at its CPU time, the link
    stays this machine's; on the GPUs that compute runs :data:`SPEEDUP` times faster. How much
    waiting for a core stretched a rank's compute here: ``cpu_from="spans"``, wall over CPU
    time of the compute spans it traced (pipelines, whose messages fall between them);
    ``"step"``, its step less its waits for messages over the step's CPU time (tensor
    parallelism, whose messages fall inside its compute)."""
    rows = []
    for s in steps:
        spans = {t.rank: next(e for e in t.events if e.name == "step" and e.micro_batch == s)
                 for t in traces}  # fmt: skip
        windows = {r: [(t.origin + spans[r].start, t.origin + spans[r].end)]
                   for r, t in ((t.rank, t) for t in traces)}  # fmt: skip
        run = Run(f"step {s}", list(traces), windows)
        here = run.loopback()
        if cpu_from == "step":
            wall = compute_per_step(run.graph(here))
            slowed = {r: max(1.0, wall[r] / spans[r].cpu) for r in wall}
        else:
            slowed = {t.rank: _stretch(t, *windows[t.rank][0]) for t in traces}
        gpu = {r: SPEEDUP * v for r, v in slowed.items()}
        rows.append(dict(zip(HARDWARE, (
            max(e.end - e.start for e in spans.values()),
            replay(run, link=here).max_step_s,
            replay(run, Topology(here, here), slowed, link=here).max_step_s,
            replay(run, NVLINK_NODE, gpu, link=here).max_step_s,
        ))))  # fmt: skip
    return {key: fmean(row[key] for row in rows) for key in HARDWARE}


def _stretch(trace: CommTrace, start: float, end: float) -> float:
    """Wall over CPU time of ``trace``'s compute spans that began in ``[start, end)``."""
    spans = [e for e in trace.events
             if e.name != "step" and e.cpu and start <= trace.origin + e.start < end]  # fmt: skip
    return max(1.0, sum(e.end - e.start for e in spans) / sum(e.cpu for e in spans))


class Prediction(NamedTuple):
    hardware: str
    devices: int
    one_s: float  # one device's step on the run's global batch
    step_s: float  # ``devices`` devices' step on the same global batch

    @property
    def speedup(self) -> float:
        return self.one_s / self.step_s


def machines(loopback: Link | None = None) -> dict[str, dict]:
    """The named hardware: a label and the arguments of ``predict_step`` for each."""
    link = loopback or PRESETS["loopback"]
    return {
        f"{CPU_CORES}-core CPU (1 thread a process, this machine's loopback)":
            {"topo": Topology(link, link), "speed": 1.0, "cores": CPU_CORES, "threads": 1},
        f"GPUs over NVLink 4 (compute {SPEEDUP:g}x this CPU's)":
            {"topo": parse_topology("nvlink"), "speed": SPEEDUP},
    }  # fmt: skip


def speedups(prof: Profile, loopback: Link | None = None,
             devices: dict[str, tuple[int, ...]] | None = None) -> list[Prediction]:  # fmt: skip
    """Predicted step at 1 device and at each of ``devices`` (per machine; default: 2 and
    16 processes on the CPU, 2 and 8 GPUs), the run's global batch kept."""
    counts = list((devices or {}).values()) or [(2, CPU_CORES), (2, GPUS)]
    out = []
    for (label, kw), ps in zip(machines(loopback).items(), counts):
        one = predict_step(prof, 1, weak=False, **kw)
        out += [Prediction(label, p, one, predict_step(prof, p, weak=False, **kw)) for p in ps]
    return out


def show(measured: str, predictions: list[Prediction]) -> None:
    """Print the measured run beside the predictions."""
    print(f"measured here: {measured}")
    for pred in predictions:
        print(
            f"predicted, {pred.hardware}: 1 device {pred.one_s * 1e3:.2f} ms a step, "
            f"{pred.devices} devices {pred.step_s * 1e3:.2f} ms: {pred.speedup:.2f}x faster"
        )
