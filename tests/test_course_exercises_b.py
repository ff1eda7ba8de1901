"""The exercise checks of notebooks 04-09 reject the wrong answers a student can give (the
helper the notebook imports, borrowed; the weights gathered instead of the outputs; a number
looked up in the notebook's own table; the optimizer state left whole; the loss divided by the
new world size) and accept the model answer in ``course/solutions/``.

Each notebook's check is taken from the stored notebook itself (its imports, the definitions
the check needs, the check cell without its ``with checking(...)`` blocks) and run in a fresh
Python process on each answer; the answer must be rejected by the check that
``_course_answers.py`` names (its message), not by an accident."""

import ast
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _course_answers import EXERCISES, VERDICTS

ROOT = Path(__file__).parent.parent
COURSE = ROOT / "course"


def _code_cells(stem: str) -> list[str]:
    cells = json.loads((COURSE / f"{stem}.ipynb").read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


def _statements(source: str, keep) -> list[str]:
    tree = ast.parse(source)
    return [ast.get_source_segment(source, node) for node in tree.body if keep(node)]


def _names(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.FunctionDef | ast.ClassDef):
        return {node.name}
    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
    return {n.id for t in targets if t is not None for n in ast.walk(t) if isinstance(n, ast.Name)}


def notebook_check(stem: str, check_cell: str, names: set[str], whole: tuple[str, ...] = ()) -> str:
    """The code that sets up ``stem``'s check: the first cell, every cell's imports, the top-level
    definitions called ``names`` in any cell, the cells that start with one of ``whole`` in full,
    and the cell that starts with ``check_cell`` without its ``with`` blocks (the checks)."""
    cells = _code_cells(stem)
    parts = [cells[0]]
    for cell in cells[1:]:
        if any(cell.startswith(w) for w in whole):
            parts.append(cell)
        elif cell.startswith(check_cell):
            parts += _statements(cell, lambda node: not isinstance(node, ast.With))
        else:
            parts += _statements(
                cell,
                lambda node: (
                    isinstance(node, ast.Import | ast.ImportFrom)
                    or (
                        not isinstance(node, ast.Expr | ast.With | ast.For) and _names(node) & names
                    )
                ),
            )
    return "\n\n".join(parts)


RUNNER = """
import json, sys, traceback
verdicts = {}
for label, source in ANSWERS.items():
    exec(source, globals())
    try:
        exec(CALL, globals())
    except AssertionError as error:
        verdicts[label] = "rejected: " + (str(error) or traceback.format_exc(limit=-1))
    else:
        verdicts[label] = "accepted"
print("VERDICTS " + json.dumps(verdicts))
"""


@functools.cache
def _verdicts(stem: str) -> dict[str, str]:
    setup, call, wrong = EXERCISES[stem]
    answers = {**wrong, "solution": (COURSE / "solutions" / f"{stem}.py").read_text()}
    script = "\n".join([
        f"import sys; sys.path.insert(0, {str(COURSE)!r})",
        notebook_check(stem, **setup),
        f"ANSWERS = {answers!r}",
        f"CALL = {call!r}",
        RUNNER,
    ])  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env,
        timeout=600,
    )  # fmt: skip
    lines = [line for line in run.stdout.splitlines() if line.startswith("VERDICTS ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("VERDICTS "))


@pytest.mark.parametrize(("stem", "answer"), sorted(VERDICTS), ids=lambda v: v[:24])
def test_the_check_rejects_the_wrong_answer_and_accepts_the_solution(stem, answer):
    verdict = _verdicts(stem)[answer]
    expected = VERDICTS[stem, answer]
    if expected is None:
        assert verdict == "accepted", verdict
    else:
        assert verdict.startswith("rejected: ") and expected in verdict, verdict


def test_every_answer_of_the_table_is_judged():
    for stem, (_, _, wrong) in EXERCISES.items():
        assert {a for s, a in VERDICTS if s == stem} == {*wrong, "solution"}, stem
