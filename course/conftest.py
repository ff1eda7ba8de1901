"""The course's test run executes every notebook with its exercise solved: the cell tagged
``exercise`` is replaced by ``solutions/<notebook>.py``, so the check after it is real."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ["LIGHTNING_PAR_COURSE_SOLUTIONS"] = "1"  # (exercise.SOLUTIONS_ENV), for the kernels
SOLUTIONS = Path(__file__).parent / "solutions"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        cell = getattr(item, "cell", None)
        if cell is None or "exercise" not in cell.get("metadata", {}).get("tags", []):
            continue
        solution = SOLUTIONS / f"{Path(str(item.fspath)).stem}.py"
        if not solution.exists():
            raise pytest.UsageError(f"{item.nodeid}: an exercise cell without {solution}")
        cell.source = solution.read_text()
