"""The README's Python snippets run as written: each compiles, imports everything it uses
(and those imports resolve), and asks for no more processes than the cores of the 2-core
machine the README describes."""

import ast
import builtins
import importlib
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
CORES = 2  # the development machine of the README's figures


def _defined_and_used(tree: ast.AST) -> tuple[set[str], set[str]]:
    defined, used = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name):
            (defined if isinstance(node.ctx, ast.Store) else used).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
    return defined, used


def test_the_readme_has_python_snippets():
    assert len(SNIPPETS) >= 6


@pytest.mark.parametrize("code", SNIPPETS, ids=[f"snippet{i}" for i in range(len(SNIPPETS))])
def test_a_snippet_imports_what_it_uses_and_fits_the_cores(code):
    tree = ast.parse(code)
    defined, used = _defined_and_used(tree)
    assert used <= defined, f"used without an import or assignment: {used - defined}\n{code}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
    for devices in re.findall(r"devices=(\d+)", code):
        assert int(devices) <= CORES, f"devices={devices} on a {CORES}-core machine:\n{code}"
