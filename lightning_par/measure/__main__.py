"""``python -m lightning_par.measure --timeout SECONDS ROWS``: the rows' subprocess of
:func:`lightning_par.measure.run.run_all` (``ROWS``: a JSON list of rows), one result line
per row. Not for users: ``python -m lightning_par.compare`` and ``python -m
lightning_par.simulate --validate`` start it."""

from __future__ import annotations

import argparse
import json
import sys

from lightning_par.launch.processes import exit_on_sigterm
from lightning_par.measure.run import run_rows
from lightning_par.quiet import quiet_lightning


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_par.measure")
    parser.add_argument("--timeout", type=float, required=True, help="seconds per row")
    parser.add_argument("rows", help="the rows, a JSON list")
    args = parser.parse_args(argv)
    quiet_lightning()
    return run_rows(json.loads(args.rows), args.timeout)


if __name__ == "__main__":
    exit_on_sigterm()  # (its temporary folders go on kill or timeout, as on Ctrl-C)
    sys.exit(main())
