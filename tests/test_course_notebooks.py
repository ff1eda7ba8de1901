"""The stored course notebooks: one checked exercise each, with its solution beside it, and
outputs a student can read (no machine paths, no Lightning chatter, no development talk)."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

COURSE = Path(__file__).parent.parent / "course"
NOTEBOOKS = sorted(COURSE.glob("[0-9][0-9]_*.ipynb"))

#: What a stored output must not show.
MACHINE_PATH = re.compile(r"(/work/|/tmp/|/home/|/root/|/Users/|site-packages|[A-Z]:\\\\)")
CHATTER = (
    "GPU available:", "TPU available:", "HPU available:", "LOCAL_RANK:", "Trainer.fit` stopped",
    "PossibleUserWarning", "Missing logger folder", "You defined a `validation_step`",
    "does not have many workers", "Trainer(limit_", "LeafSpec",
)  # fmt: skip
#: What the text a student reads must not say (it is about making the course, not the lesson).
DEVELOPMENT = re.compile(
    r"\b(so CI|in CI|CI fails|our runs|while we ran|stored outputs? come|nbval)\b", re.I
)


def _cells(nb: Path) -> list[dict]:
    return json.loads(nb.read_text())["cells"]


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda nb: nb.name[:2])
def test_each_notebook_keeps_the_gpu_out_of_its_kernel_before_torch(nb):
    # On a machine with a GPU, a backward pass in the kernel starts autograd's GPU threads
    # and every later fork launch is refused: the first cell hides the GPU before torch loads
    # (CUDA reads the variable once, when it starts).
    first = _text(next(c for c in _cells(nb) if c["cell_type"] == "code")["source"])
    hide = first.find('os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")')
    torch = first.find("import torch")
    assert hide != -1 and (torch == -1 or hide < torch), first[:400]
    assert first.find("import lightning") == -1 or hide < first.find("import lightning")


def test_the_course_is_numbered_in_reading_order():
    assert [nb.name[:2] for nb in NOTEBOOKS] == [f"{i:02d}" for i in range(len(NOTEBOOKS))]
    assert len(NOTEBOOKS) >= 7


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_one_checked_exercise_with_its_solution(nb):
    """One exercise per notebook, in one or more parts (02 and 03 add a part that builds on
    the previous notebook's): each part a cell tagged ``exercise`` whose stub the solution
    file fills in, followed by the cell that checks it."""
    cells = _cells(nb)
    tagged = [i for i, c in enumerate(cells) if "exercise" in c["metadata"].get("tags", [])]
    assert 1 <= len(tagged) <= 2, f"{nb.name}: {len(tagged)} cells tagged 'exercise', want 1-2"
    solution = COURSE / "solutions" / f"{nb.stem}.py"
    assert solution.exists(), f"{nb.name}: no {solution.relative_to(COURSE.parent)}"
    answer = solution.read_text()
    assert "NotImplementedError" not in answer

    def defined(source: str) -> set[str]:
        tree = ast.parse(source)
        return {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}

    stubs: set[str] = set()
    for part, index in enumerate(tagged):
        stub = _text(cells[index]["source"])
        assert cells[index]["cell_type"] == "code" and "NotImplementedError" in stub
        assert defined(stub) and not defined(stub) & stubs, f"{nb.name}: part {part} redefines"
        stubs |= defined(stub)
        after = [c for c in cells[index + 1 :] if c["cell_type"] == "code"]
        assert after and "checking(" in _text(after[0]["source"]), "the next cell checks it"
    assert stubs == defined(answer), "the solution fills in every part's stub, nothing else"


#: The exercise path (issue 30): a ring from send/recv (01) -> gradient buckets summed by that
#: ring during backward (02, part b) -> a Lightning strategy from both (03, part b). Each step
#: loads the earlier answers (the model answers, or the student's own pasted in their place).
CHAIN = {
    "02_parameter_server": {"01_allreduce"},
    "03_async_sgd": {"01_allreduce", "02_parameter_server"},
}
LOADED = re.compile(r'runpy\.run_path\("solutions/(\w+)\.py"\)\["(\w+)"\]')


@pytest.mark.parametrize("stem", sorted(CHAIN))
def test_the_exercise_path_builds_on_the_earlier_answers(stem):
    cells = _cells(COURSE / f"{stem}.ipynb")
    last = max(i for i, c in enumerate(cells) if "exercise" in c["metadata"].get("tags", []))
    before = "\n".join(_text(c["source"]) for c in cells[:last] if c["cell_type"] == "code")
    loaded = LOADED.findall(before)
    assert {name for name, _ in loaded} == CHAIN[stem], f"{stem} loads {loaded} before its exercise"
    for name, symbol in loaded:
        tree = ast.parse((COURSE / "solutions" / f"{name}.py").read_text())
        assert symbol in {n.name for n in tree.body if hasattr(n, "name")}, (name, symbol)


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_outputs_show_no_machine_paths_or_chatter(nb):
    for i, cell in enumerate(_cells(nb)):
        source = _text(cell["source"])
        assert not re.search(r"filterwarnings\(\s*['\"]ignore['\"]\s*\)", source), (
            f"{nb.name} cell {i}: a blanket warning filter hides what a student should see"
        )
        if cell["cell_type"] == "markdown":
            found = DEVELOPMENT.search(source)
            assert not found, f"{nb.name} cell {i}: development wording {found.group(0)!r}"
        for out in cell.get("outputs", []):
            text = _text(out.get("text", "")) + _text(out.get("data", {}).get("text/plain", ""))
            text += "".join(_text(t) for t in out.get("traceback", []))
            found = MACHINE_PATH.search(text)
            assert not found, f"{nb.name} cell {i}: a machine path in the output: {found.group(0)}"
            for phrase in CHATTER:
                assert phrase not in text, f"{nb.name} cell {i}: Lightning chatter {phrase!r}"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_temporary_folders_go_when_the_notebook_ends(nb):
    """A notebook's scratch folder is a ``tempfile.TemporaryDirectory`` (removed at the
    kernel's exit even after a failed cell) that the last code cell cleans up: a
    ``mkdtemp`` folder stayed in /tmp after every run."""
    code = [_text(c["source"]) for c in _cells(nb) if c["cell_type"] == "code"]
    for source in code:
        found = re.search(r"\bmk[sd]temp\(", source)
        assert not found, f"{nb.name}: {found.group(0)} leaves its file or folder behind"
    kept = re.findall(r"^(\w+) = tempfile\.TemporaryDirectory\(", "\n".join(code), re.M)
    for name in kept:
        assert f"{name}.cleanup()" in code[-1], f"{nb.name}: the last cell keeps {name}"


def test_checking_says_open_then_checks_for_real(tmp_path):
    script = """
import sys; sys.path.insert(0, sys.argv[1])
from exercise import checking
def todo(): raise NotImplementedError
with checking("open one"):
    todo()
with checking("done one"):
    assert 1 + 1 == 2
try:
    with checking("wrong one"):
        assert 1 + 1 == 3
except AssertionError:
    print("wrong answer fails")
"""

    def run_with(solutions: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "LIGHTNING_PAR_COURSE_SOLUTIONS": solutions}
        argv = [sys.executable, "-c", script, str(COURSE)]
        return subprocess.run(argv, capture_output=True, text=True, env=env)

    run = run_with("0")
    assert run.returncode == 0, run.stderr
    assert "(open one): still open" in run.stdout and "(done one): correct" in run.stdout
    assert "wrong answer fails" in run.stdout
    strict = run_with("1")
    assert strict.returncode != 0 and "NotImplementedError" in strict.stderr


def test_broken_reports_a_caught_mutation_and_fails_on_a_survivor(tmp_path):
    script = """
import sys; sys.path.insert(0, sys.argv[1])
from breakit import CAUGHT, MutationSurvived, broken
with broken("sum, not mean", caught_by="the mean check"):
    assert sum([1, 3]) == 2, "not the mean"
assert CAUGHT == [("sum, not mean", "the mean check")]
try:
    with broken("harmless", caught_by="a loose check"):
        assert 2 < 3
except MutationSurvived as error:
    print("survivor:", error)
try:
    with broken("typo", caught_by="x"):
        raise KeyError("k")
except KeyError:
    print("other errors propagate")
"""
    run = subprocess.run(
        [sys.executable, "-c", script, str(COURSE)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert "Break it (sum, not mean): caught by the mean check: not the mean" in run.stdout
    assert "survivor: mutation 'harmless' passed a loose check" in run.stdout
    assert "other errors propagate" in run.stdout


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_notebook_ends_by_breaking_what_it_taught(nb):
    """A cell tagged ``break-it`` runs the lesson's own checks on at least two named
    mutations (``breakit.broken``); the notebook's test run then fails if one survives."""
    cells = _cells(nb)
    tagged = [c for c in cells if "break-it" in c["metadata"].get("tags", [])]
    assert tagged, f"{nb.name}: no cell tagged 'break-it'"
    calls = [
        node
        for cell in tagged
        for node in ast.walk(ast.parse(_text(cell["source"])))
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "broken"
    ]
    assert len(calls) >= 2, f"{nb.name}: {len(calls)} broken(...) mutations, want two or more"
    for call in calls:
        assert call.args and isinstance(call.args[0], ast.Constant), "name the mutation"
        assert any(k.arg == "caught_by" for k in call.keywords), "say which check catches it"


def test_the_figure_check_names_each_missing_part():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, str(COURSE))
    try:
        from figurecheck import problems
    finally:
        sys.path.remove(str(COURSE))
    fig, (good, bad) = plt.subplots(1, 2)
    good.plot([1, 2], [3, 4], label="a")
    good.plot([1, 2], [4, 5], label="b")
    good.set(title="good", xlabel="step", ylabel="time per step (ms)")
    good.legend()  # one legend serves panels that share their colours
    bad.plot([1, 2], [3, 4])
    bad.plot([1, 2], [4, 5])
    bad.set(ylabel="wall time")
    assert problems(fig) == [
        "figure 'good', axes 1: no title (set the axes title or the figure's suptitle)",
        "figure 'good', axes 1: no x label",
        "figure 'good', axes 1: the y label 'wall time' names no unit",
    ]
    fig.suptitle("both titled")
    bad.set(xlabel="step", ylabel="wall time (s)")
    assert problems(fig) == []
    bad.set(ylabel="ring time / butterfly time")  # a ratio has no unit
    assert problems(fig) == []
    colours, ax = plt.subplots()
    ax.plot([1, 2], [3, 4], label="a")
    ax.plot([1, 2], [4, 5], label="b")
    ax.set(title="two curves", xlabel="step", ylabel="loss")
    assert problems(colours) == [
        "figure 'two curves', axes 0 'two curves': 2 colours but no legend"
    ]
    colours.legend()
    assert problems(colours) == []
    diagram, ax = plt.subplots()
    ax.add_patch(matplotlib.patches.Rectangle((0, 0), 1, 1))
    ax.set_title("a diagram")
    ax.axis("off")
    assert problems(diagram) == []  # no axes to label
    rows, ax = plt.subplots()
    ax.barh([0, 1], [3, 4])
    ax.set_yticks([0, 1], ["rank 0", "rank 1"])  # named rows need no y label
    ax.set(title="rows", xlabel="time (ms)")
    assert problems(rows) == []
    ax.set_yticks([0, 1], ["0", "1"])
    assert problems(rows) == ["figure 'rows', axes 0 'rows': no y label"]
    plt.close("all")
