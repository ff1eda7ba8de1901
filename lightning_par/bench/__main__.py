"""Dispatch ``python -m lightning_par.bench NAME ...`` to ``lightning_par.bench.NAME.main``.

Every benchmark runs under a wall-clock limit (``LIGHTNING_PAR_BENCH_TIMEOUT`` seconds,
default 1800): past it the benchmark is stopped where it is, and the launcher or
``run_on_ranks`` that started its ranks kills every one of them, so nothing hangs.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import lightning_par.bench as bench_pkg
from lightning_par.quiet import quiet_lightning


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(bench_pkg.__path__) if m.name[0] != "_")


class BenchmarkTimeout(RuntimeError):
    """A benchmark ran past its wall-clock limit."""


@contextmanager
def time_limit(name: str, seconds: float) -> Iterator[None]:
    """Raise :class:`BenchmarkTimeout` in the main thread after ``seconds``."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum, frame):
        raise BenchmarkTimeout(
            f"benchmark {name!r} ran past its {seconds:.0f} s limit (LIGHTNING_PAR_BENCH_TIMEOUT); "
            "every rank it started was stopped"
        )

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = available()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in names:
        print("usage: python -m lightning_par.bench {" + ",".join(names) + "} [options]")
        print("       python -m lightning_par.bench NAME --help for a benchmark's options")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    quiet_lightning()
    module = importlib.import_module(f"lightning_par.bench.{argv[0]}")
    limit = float(os.environ.get("LIGHTNING_PAR_BENCH_TIMEOUT", 1800))
    with time_limit(argv[0], limit):
        return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
