"""Dispatch ``python -m lightning_par.bench NAME ...`` to ``lightning_par.bench.NAME.main``.

Every benchmark runs under a wall-clock limit (``LIGHTNING_PAR_BENCH_TIMEOUT`` seconds,
default 1800): past it the benchmark is stopped where it is, and the launcher or
``run_on_ranks`` that started its ranks kills every one of them, so nothing hangs.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys

import lightning_par.bench as bench_pkg
from lightning_par.launch.processes import exit_on_sigterm, time_limit
from lightning_par.quiet import quiet_report


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(bench_pkg.__path__) if m.name[0] != "_")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = available()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in names:
        print("usage: python -m lightning_par.bench {" + ",".join(names) + "} [options]")
        print("       python -m lightning_par.bench NAME --help for a benchmark's options")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    quiet_report()
    module = importlib.import_module(f"lightning_par.bench.{argv[0]}")
    limit = float(os.environ.get("LIGHTNING_PAR_BENCH_TIMEOUT", 1800))
    with time_limit(
        limit,
        f"benchmark {argv[0]!r} ran past its {limit:.0f} s limit "
        "(LIGHTNING_PAR_BENCH_TIMEOUT); every rank it started was stopped",
    ):
        return module.main(argv[1:]) or 0


if __name__ == "__main__":
    exit_on_sigterm()  # (its temporary folders go on kill or timeout, as on Ctrl-C)
    sys.exit(main())
