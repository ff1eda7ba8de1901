"""The course's test run executes every notebook with its exercise solved: each cell tagged
``exercise`` is replaced by ``solutions/<notebook>.py`` (which fills in every part of the
exercise), so the check after it is real.

Each notebook's kernel also checks every figure it shows (``figurecheck.py``): an IPython
startup file in a private ``IPYTHONDIR`` registers the check, and a figure without a title,
axis labels (with units) or a needed legend fails the cell that drew it."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ["LIGHTNING_PAR_COURSE_SOLUTIONS"] = "1"  # (exercise.SOLUTIONS_ENV), for the kernels
COURSE = Path(__file__).parent
SOLUTIONS = COURSE / "solutions"

_ipython_dir = Path(tempfile.mkdtemp(prefix="lightning_par_course_ipython_"))
atexit.register(shutil.rmtree, _ipython_dir, ignore_errors=True)
(_ipython_dir / "profile_default" / "startup").mkdir(parents=True)
(_ipython_dir / "profile_default" / "startup" / "00-figurecheck.py").write_text(
    f"import sys\nsys.path.insert(0, {str(COURSE)!r})\nimport figurecheck\n"
    "figurecheck.register(get_ipython())\ndel sys, figurecheck\n"
)
os.environ["IPYTHONDIR"] = str(_ipython_dir)  # the kernels nbval starts inherit it


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        cell = getattr(item, "cell", None)
        if cell is None or "exercise" not in cell.get("metadata", {}).get("tags", []):
            continue
        solution = SOLUTIONS / f"{Path(str(item.fspath)).stem}.py"
        if not solution.exists():
            raise pytest.UsageError(f"{item.nodeid}: an exercise cell without {solution}")
        cell.source = solution.read_text()
