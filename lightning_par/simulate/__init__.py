"""What if: replay a run's traces on another network, another device, another scale.

* :mod:`.ops`, :mod:`.engine` - a step's graph (lanes of compute, messages, joins) and the
  discrete-event engine that replays it;
* :mod:`.graph` - per-rank traces to the step's dependency graph;
* :mod:`.links` - link classes with their sources, topologies, the loopback fit;
* :mod:`.replay` - load a run folder and replay it;
* :mod:`.profile`, :mod:`.builders`, :mod:`.scale` - a small run's profile, each
  strategy's graph at ``p`` (:mod:`.model_parallel_graphs`, costs in :mod:`.step_costs`),
  its step and efficiency there;
* :mod:`.cores` - ranks sharing a machine's cores (processor sharing);
* :mod:`.validate`, :mod:`.report` - measured against predicted; tables and charts;
* :mod:`.by_hand` - :func:`predict_step`: one data-parallel step, to check a hand prediction.

Plain Python on top of the traces (no Lightning). ``python -m lightning_par.simulate --help``.
"""

from lightning_par.simulate.by_hand import predict_step, step_parts
from lightning_par.simulate.engine import Result, simulate
from lightning_par.simulate.links import PRESETS, Link, Topology, parse_topology
from lightning_par.simulate.ops import Graph
from lightning_par.simulate.replay import Run, load_run, replay

__all__ = ["PRESETS", "Graph", "Link", "Result", "Run", "Topology", "load_run",
           "parse_topology", "predict_step", "replay", "simulate", "step_parts"]  # fmt: skip
