"""How well ``lightning_par.simulate`` predicts this machine: every validation row.

    python -m lightning_par.bench simulate [--rounds 2] [--work DIR]
    python -m lightning_par.bench simulate --reuse DIR   # the rows again from kept runs

The same as ``python -m lightning_par.simulate --validate --json``: trains the allreduce
family, ``parameter_server``, ``gpipe`` and ``tensor_parallel`` at 2, 3 and 4 workers,
interleaved, then prints one JSON row per (strategy, kind): ``replay`` (the 2-worker run
replayed on its fitted loopback) and ``scale 2->3`` / ``scale 2->4`` (predicted from the
2-worker run), with ``measured_s``, ``predicted_s`` and ``error``, and for the scale rows
the predicted and measured per-step compute / communication / waiting (which part missed).
Every row, misses too; ``load_1m_start`` / ``load_1m_end`` say how busy the machine was.
"""

from __future__ import annotations

import argparse

from lightning_par.simulate.__main__ import main as simulate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_par.bench simulate",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2, help="runs per strategy and size")
    parser.add_argument("--work", help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--reuse", metavar="DIR", help="the runs a --work DIR kept (no training)")
    args = parser.parse_args(argv)

    extra = ["--work", args.work] if args.work else []
    if args.reuse:
        extra = ["--reuse", args.reuse]
    return simulate(["--validate", "--json", "--rounds", str(args.rounds), *extra])
