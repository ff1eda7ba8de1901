"""The project's dependencies for a second virtual environment on another torch: one per line,
as ``pip install -r`` reads them, with some pinned and some left out.

    python -m tests.smoke.requirements --pin torch==2.13.0+cpu --leave-out torchvision jupyter

Reads ``[project].dependencies`` of ``pyproject.toml`` with the standard library only
(Python >= 3.11's ``tomllib``: it runs before any virtual environment exists).
``make smoke-old-torch`` builds ``.venv-torch213`` from it: torch 2.13.0's CPU file; no
torchvision (the index's torchvision 0.28.0 is a CUDA build whose operators do not load
beside a CPU torch, and a torchvision that fails to load stops even ``import lightning``,
through torchmetrics); no jupyter (the notebooks are not smoke-run). The project itself is
then installed without its dependencies.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import tomllib

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def name_of(requirement: str) -> str:
    """The distribution a requirement names (``"jsonargparse[signatures]>=4.27"``:
    ``"jsonargparse"``), lower case."""
    return re.split(r"[\[<>=!~;\s]", requirement.strip(), maxsplit=1)[0].lower()


def requirements(pins: list[str], leave_out: list[str], pyproject: Path = PYPROJECT) -> list[str]:
    """The project's dependencies, each pinned one replaced by its pin, the left-out ones
    dropped."""
    declared = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    pinned = {name_of(p): p for p in pins}
    dropped = {name.lower() for name in leave_out}
    unknown = (set(pinned) | dropped) - {name_of(r) for r in declared}
    if unknown:
        raise SystemExit(f"not dependencies of the project: {sorted(unknown)}")
    return [pinned.get(name_of(r), r) for r in declared if name_of(r) not in dropped]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pin", nargs="*", default=[], help="exact requirements to use")
    parser.add_argument("--leave-out", nargs="*", default=[], help="dependencies to drop")
    args = parser.parse_args()
    print("\n".join(requirements(args.pin, args.leave_out)))


if __name__ == "__main__":
    main()
