"""The old-torch smoke run (``make smoke-old-torch``, ``tests/smoke/``) covers every benchmark,
and its second venv takes the project's dependencies with torch pinned and torchvision left
out (the smoke run itself is ``make test``'s, not pytest's)."""

from __future__ import annotations

import importlib

import pytest

from lightning_par.bench.__main__ import available
from tests.smoke.requirements import name_of, requirements
from tests.smoke.run import NEEDS_TORCHVISION, SMALLEST


def test_every_benchmark_has_its_smallest_settings():
    modules = {n: importlib.import_module(f"lightning_par.bench.{n}") for n in available()}
    benchmarks = {name for name, module in modules.items() if hasattr(module, "main")}
    assert set(SMALLEST) == benchmarks
    assert set(NEEDS_TORCHVISION) <= benchmarks


def test_the_old_venv_takes_the_projects_dependencies_pinned_and_left_out():
    wanted = requirements(["torch==2.13.0+cpu"], ["torchvision", "jupyter"])
    assert wanted[0] == "torch==2.13.0+cpu"
    names = [name_of(r) for r in wanted]
    assert "torchvision" not in names and "jupyter" not in names
    assert {"lightning", "torchmetrics", "jsonargparse", "matplotlib"} <= set(names)
    assert name_of("jsonargparse[signatures]>=4.27") == "jsonargparse"
    with pytest.raises(SystemExit, match="not dependencies of the project: \\['torchvison'\\]"):
        requirements([], ["torchvison"])
