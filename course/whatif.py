"""What a 2-core machine cannot show: a notebook's own run replayed on other hardware.

:func:`speedups` gives a run's profile (:mod:`lightning_par.simulate.profile`, from its
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

from typing import NamedTuple

from lightning_par.compare.predicted import SPEEDUP
from lightning_par.simulate.links import PRESETS, Link, Topology, parse_topology
from lightning_par.simulate.profile import Profile
from lightning_par.simulate.scale import predict_step

CPU_CORES = 16
GPUS = 8


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
