"""The layers of ARCHITECTURE.md, checked on the code itself: imports that only point down
the layers (algorithms -> components -> strategies -> tools) with no circle, function-level
imports that say why, and ARCHITECTURE.md naming every package and file that exists. The
strategy classes' shape and ``@override`` are checked in ``test_strategy_classes.py``."""

from __future__ import annotations

import ast
import pathlib

import lightning_par

PACKAGE = pathlib.Path(lightning_par.__file__).parent


# ---- imports --------------------------------------------------------------------------------
#: The layers, lowest first, each with its packages lowest first (a package is a folder or a
#: module right under lightning_par; ``""`` is lightning_par itself, which registers the
#: strategies). A module imports from its own package and from packages placed before it:
#: never up a layer, never up the order within one, so never in a circle.
LAYERS: dict[str, tuple[str, ...]] = {
    "algorithms": (
        "_compat", "quiet", "output", "split", "launch", "comm", "collectives", "zero", "graphcut",
        "pipeline", "modelparallel", "tensorparallel", "hybrid", "paramserver", "data", "models",
    ),
    "components": ("components",),
    "strategies": ("callbacks", "strategies", ""),
    "tools": (
        "features", "summary", "cli_checks", "cli_help", "cli_strategy", "check", "gpucheck",
        "measure", "simulate", "compare", "bench", "cli", "__main__",
    ),
}  # fmt: skip
#: Every package's place, lowest first.
ORDER = [package for packages in LAYERS.values() for package in packages]


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str:
    """``lightning_par.pipeline.partition`` -> ``pipeline``; ``lightning_par`` -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer(module: str) -> str:
    return next(name for name, packages in LAYERS.items() if _package(module) in packages)


def _imports() -> list[tuple[str, str, int]]:
    """(importer, imported, line) for every import of one of our modules, at any level."""
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    found = []
    for path in PACKAGE.rglob("*.py"):
        importer = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_par"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.append((importer, sub if sub in modules else node.module, node.lineno))
            elif isinstance(node, ast.Import):
                found += [(importer, a.name, node.lineno) for a in node.names
                          if a.name.startswith("lightning_par")]  # fmt: skip
    return [(a, b, line) for a, b, line in found if b in modules]


def upward_imports() -> list[str]:
    """Every import of a package placed above the importer's (:data:`LAYERS`)."""
    return sorted(
        {
            f"{a}:{line} -> {b} ({_layer(a)} -> {_layer(b)})"
            for a, b, line in _imports()
            if ORDER.index(_package(b)) > ORDER.index(_package(a))
        }
    )


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each back edge of a depth-first walk of ``graph``: none when
    ``graph`` has no circle."""
    state: dict[str, int] = {}
    path: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return circles


def module_circles() -> list[list[str]]:
    """Circles of imports between modules (a package importing its own parts, or a part its
    package, is not an edge: ``__init__`` re-exports)."""
    graph: dict[str, set[str]] = {}
    for a, b, _ in _imports():
        if not b.startswith(a + ".") and not a.startswith(b + "."):
            graph.setdefault(a, set()).add(b)
    return _circles(graph)


def package_circles() -> list[list[str]]:
    """Circles of imports between packages: ``pipeline.network`` importing ``graphcut`` while
    ``graphcut.auto`` imports ``pipeline.partition`` is one, though no module is in it twice."""
    graph: dict[str, set[str]] = {}
    for a, b, _ in _imports():
        if _package(a) != _package(b):
            graph.setdefault(_package(a), set()).add(_package(b))
    return _circles(graph)


def test_every_package_has_its_place() -> None:
    found = {_package(_module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert found == set(ORDER), f"place in LAYERS: {found - set(ORDER)}; gone: {set(ORDER) - found}"


def test_no_import_points_up() -> None:
    upward = upward_imports()
    assert not upward, f"imports pointing up the layers or the order within one: {upward}"


def test_no_import_circle_between_packages() -> None:
    assert not package_circles(), f"packages importing each other: {package_circles()}"


def test_no_import_circle_between_modules() -> None:
    assert not module_circles(), f"import circles: {module_circles()}"


def test_the_circle_check_sees_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c", "a"]]
    assert _circles({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) == []


# ---- function-level imports -----------------------------------------------------------------
def _scan(text: str) -> set[tuple[int, bool]]:
    """(line, commented) for every import of one of our modules inside a function of
    ``text``. An import counts as commented when a ``#`` comment is on its lines, or on the
    comment lines and imports directly above it (one comment may explain a block)."""
    lines = text.splitlines()
    found = set()
    for func in ast.walk(ast.parse(text)):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if not any(n.startswith("lightning_par") for n in names):
                continue
            own = lines[node.lineno - 1 : node.end_lineno]
            above = node.lineno - 2
            while above >= 0 and lines[above].strip().startswith(("#", "from ", "import ")):
                own.append(lines[above])
                above -= 1
            found.add((node.lineno, any("#" in x for x in own)))
    return found


def _function_level_imports() -> list[tuple[str, int, bool]]:
    """(module, line, commented) for every function-level import of our modules."""
    return sorted(
        (_module_name(path), line, commented)
        for path in PACKAGE.rglob("*.py")
        for line, commented in _scan(path.read_text())
    )


#: Function-level imports of our own modules without a comment saying why (slow, optional
#: or a cycle), per module: none; a new one needs its comment (or belongs at the top).
UNCOMMENTED: dict[str, int] = {}


def test_function_level_imports_say_why() -> None:
    counts: dict[str, int] = {}
    for module, _, commented in _function_level_imports():
        if not commented:
            counts[module] = counts.get(module, 0) + 1
    grown = {m: n for m, n in counts.items() if n > UNCOMMENTED.get(m, 0)}
    assert not grown, f"function-level imports of our modules without a comment: {grown}"
    shrunk = {m: n for m, n in UNCOMMENTED.items() if counts.get(m, 0) < n}
    assert not shrunk, f"fewer uncommented imports than listed, update UNCOMMENTED: {shrunk}"


def test_the_import_check_tells_commented_from_uncommented() -> None:
    text = (
        "import lightning_par\n"  # module level: not counted
        "def f():\n"
        "    from lightning_par.models import CifarCNN\n"  # line 3: no reason given
        "    # slow: pulls in torchvision\n"
        "    from lightning_par.data import CIFAR10DataModule\n"  # line 5: commented above
        "    import lightning_par.bench  # optional\n"  # line 6: commented on its line
        "    import torch\n"  # not ours
    )
    assert _scan(text) == {(3, False), (5, True), (6, True)}


def test_launch_is_apart_from_messaging() -> None:
    """``launch/`` (processes, stores, liveness) never imports ``comm/`` (messages)."""
    imports = [(a, b) for a, b, _ in _imports()]
    crossing = [(a, b) for a, b in imports if a.startswith("lightning_par.launch.") and
                b.startswith("lightning_par.comm")]  # fmt: skip
    assert not crossing, crossing


# ---- ARCHITECTURE.md against the code -------------------------------------------------------
ARCHITECTURE = PACKAGE.parent / "ARCHITECTURE.md"


def test_architecture_md_places_every_package_in_its_layer() -> None:
    rows = {
        line.split("|")[1].strip(): line.split("|")[2]
        for line in ARCHITECTURE.read_text().splitlines()
        if line.startswith("| ") and line.split("|")[1].strip()[:2] in ("1.", "2.", "3.", "4.")
    }
    for number, (layer, packages) in enumerate(LAYERS.items(), 1):
        row = next(v for k, v in rows.items() if k.startswith(f"{number}."))
        for package in filter(None, packages):
            path = PACKAGE / package
            shown = f"`{package}/`" if path.is_dir() else f"`{package}.py`"
            assert shown in row, f"ARCHITECTURE.md: {shown} missing from the {layer} row"


def test_every_file_architecture_md_names_exists() -> None:
    import re

    named = set(re.findall(r"`((?:[a-z_]+/)+[a-z_]*(?:\.py)?)`", ARCHITECTURE.read_text()))
    roots = [PACKAGE, PACKAGE.parent]
    missing = [n for n in named if not any((root / n).exists() for root in roots)]
    # a path relative to a package named beside it ("worker.py" under paramserver/) is fine
    assert not missing, f"ARCHITECTURE.md names paths that do not exist: {sorted(missing)}"
