"""Dispatch ``python -m lightning_par.bench NAME ...`` to ``lightning_par.bench.NAME.main``."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import lightning_par.bench as bench_pkg
from lightning_par.quiet import quiet_lightning


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(bench_pkg.__path__) if m.name[0] != "_")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = available()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in names:
        print("usage: python -m lightning_par.bench {" + ",".join(names) + "} [options]")
        print("       python -m lightning_par.bench NAME --help for a benchmark's options")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    quiet_lightning()
    module = importlib.import_module(f"lightning_par.bench.{argv[0]}")
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
