"""How well ``lightning_par.simulate`` predicts this machine: every validation row.

    python -m lightning_par.bench simulate [--rounds 2] [--work DIR] [--strategies ...] [--json]
    python -m lightning_par.bench simulate --reuse DIR   # the rows again from kept runs

The same as ``python -m lightning_par.simulate --validate``: trains the allreduce family,
``parameter_server``, ``gpipe`` and ``tensor_parallel`` at 2, 3 and 4 workers,
interleaved, then prints one row per (strategy, kind): ``replay`` (the 2-worker run
replayed on its fitted loopback) and ``scale 2->3`` / ``scale 2->4`` (predicted from the
2-worker run), with ``measured_s``, ``predicted_s`` and ``error``, and for the scale rows
the predicted and measured per-step compute / wait for a core / communication (which part
missed). Every row, misses too, with its rounds' steps and their ``spread`` and the cores'
worth of CPU other processes took beside it (``other_load``); ``load_1m_start`` /
``load_1m_end`` say how busy the machine was.
There is no peer here (the simulator against this machine's own runs).
"""

from __future__ import annotations

import argparse

from lightning_par.bench._environment import RunEnvironment, print_result
from lightning_par.simulate.__main__ import validation, validation_report
from lightning_par.simulate.validate import VALIDATED


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_par.bench simulate",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2, help="runs per strategy and size")
    parser.add_argument("--work", help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--reuse", metavar="DIR", help="the runs a --work DIR kept (no training)")
    parser.add_argument("--strategies", nargs="+", default=list(VALIDATED), choices=VALIDATED,
                        help="the strategies to train (default: all)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=10, help="steps per run (4 warm up)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    if args.steps < 6:
        parser.error("--steps must be >= 6 (4 warm-up steps, then at least two timed)")
    started = RunEnvironment.now()
    try:
        doc = validation(args.work, args.reuse, args.rounds, strategies=args.strategies,
                         steps=args.steps)  # fmt: skip
    except ValueError as err:  # no traces, no probes in --reuse: say so, as the simulator does
        parser.error(str(err))
    print_result(doc, validation_report, args.json, started)
    return 0
