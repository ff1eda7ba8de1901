"""The Python snippets of the README and of the documentation pages (where the README's
longer sections moved) run as written: each compiles, imports everything it uses (and those
imports resolve), and asks for no more processes than the cores of the 2-core machine the
pages describe."""

import ast
import builtins
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("**/*.md"))]
PAGES = [p for p in PAGES if not {"_build", "_generated"} & set(p.parts)]


def _snippets(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


SNIPPETS = [code for page in PAGES for code in _snippets(page)]
IDS = [f"{page.relative_to(ROOT)}:{i}" for page in PAGES for i in range(len(_snippets(page)))]
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


def test_the_readme_and_the_pages_have_python_snippets():
    assert _snippets(README), "the README lost its smallest example"
    assert len(SNIPPETS) >= 10
    for strategy in ("allreduce", "gpipe", "layerwise", "tensor_parallel", "hybrid"):
        assert _snippets(ROOT / "docs" / "strategies" / f"{strategy}.md"), strategy


@pytest.mark.parametrize("code", SNIPPETS, ids=IDS)
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
