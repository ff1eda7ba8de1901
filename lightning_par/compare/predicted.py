"""The report's "predicted at scale" section: the simulator on this report's own runs.

:mod:`lightning_par.simulate` reads the probes and traces the compare kept under
``runs/<strategy>/`` and predicts each strategy at more devices on another network
(:data:`LINK`) with faster compute (:data:`SPEEDUP`). It is a model, not a measurement: the
section and its figure say so, with their assumptions.
"""

from __future__ import annotations

from pathlib import Path

from lightning_par.simulate.links import parse_topology
from lightning_par.simulate.profile import profile
from lightning_par.simulate.replay import load_run
from lightning_par.simulate.report import scaling_figure, scaling_table
from lightning_par.simulate.scale import scaling_row
from lightning_par.simulate.validate import own_link, pooled_loopback

#: Links of the prediction: NVLink inside 8-GPU nodes, InfiniBand NDR between them.
LINK = "nvlink+ib"
#: Compute this many times faster than measured here (a stand-in for a GPU).
SPEEDUP = 100.0
DEVICES = (8, 64, 512)
CURVE = tuple(2**k for k in range(1, 11))


def predicted_section(out: Path) -> list[str]:
    """Markdown lines (and ``predicted_scaling.png`` in ``out``); empty without runs."""
    folders = sorted(p for p in (out / "runs").glob("*") if (p / "trace").is_dir())
    runs = [load_run(f) for f in folders]
    if not runs:
        return []
    loop = pooled_loopback(runs)
    topo = parse_topology(LINK, 8, loop)
    rows, curve = [], []
    for run in runs:
        try:
            prof = profile(run, run.graph(own_link(run, loop)))
        except ValueError:  # no scale-out model for it
            continue
        rows += [scaling_row(prof, p, topo, SPEEDUP) for p in DEVICES]
        curve += [scaling_row(prof, p, topo, SPEEDUP) for p in CURVE]
    if not rows:
        return []
    assumptions = (f"links {LINK} (NVLink 4 inside 8-GPU nodes, InfiniBand NDR between), "
                   f"compute {SPEEDUP:g}x this machine's, batch per device fixed")  # fmt: skip
    picture = scaling_figure(curve, out / "predicted_scaling.png", assumptions)
    return [
        "## Predicted at scale (simulated, not measured)",
        "",
        f"`python -m lightning_par.simulate` replays these runs' traces and builds each "
        f"strategy's step at more devices from its schedule and cost model. Assumptions: "
        f"{assumptions}. Pipeline and tensor parallelism stop where this small model has no "
        "more layers or channels to split. See `docs/simulate.md` for the model and how well "
        "it predicts this machine.",
        "",
        scaling_table(rows),
        "",
        f"![{picture.name}]({picture.name})",
        "",
    ]
