"""The exercise checks of notebooks 04-07 reject the wrong answers a student can give (the
helper the notebook imports, borrowed; the weights gathered instead of the outputs; a number
looked up in the notebook's own table) and accept the model answer in ``course/solutions/``.

Each notebook's check is taken from the stored notebook itself (its imports, the definitions
the check needs, the check cell without its ``with checking(...)`` blocks) and run in a fresh
Python process on each answer; the answer must be rejected by the check named here (its
message), not by an accident."""

import ast
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


#: notebook -> (how to set up its check, the call that checks an answer, {answer: source}).
#: "solution" is course/solutions/<stem>.py.
EXERCISES = {
    "04_model_parallelism": (
        dict(check_cell="import itertools", names={"MLP"}),
        "check_balance(balance_by_bytes)",
        {
            "borrowed balance_by_cost": "from lightning_par.split import balance_by_cost\n"
            "def balance_by_bytes(layer_bytes, num_stages):\n"
            "    return balance_by_cost(layer_bytes, num_stages)\n",
            "equal layer counts": "def balance_by_bytes(layer_bytes, num_stages):\n"
            "    parts = torch.arange(len(layer_bytes)).tensor_split(num_stages)\n"
            "    return [len(p) for p in parts]\n",
        },
    ),
    "05_pipelining": (
        dict(check_cell="HIDDEN = 16", names=set()),
        "check_interleaved(interleaved_order)",
        {
            "borrowed device_schedule": "from lightning_par.pipeline.schedules import "
            "device_schedule\n"
            "def interleaved_order(device, num_devices, v, chunks):\n"
            "    return device_schedule('interleaved', num_devices, chunks, v)[device]\n",
            "all forwards first": "def interleaved_order(device, num_devices, v, chunks):\n"
            "    stages = [device + c * num_devices for c in range(v)]\n"
            "    fwd = [Step(s, 'fwd', i) for s in stages for i in range(chunks)]\n"
            "    bwd = [Step(s, 'bwd', i) for s in reversed(stages)\n"
            "           for i in reversed(range(chunks))]\n"
            "    return fwd + bwd\n",
        },
    ),
    "06_tensor_and_hybrid": (
        dict(check_cell="import inspect", names=set()),
        "check_column_linear()",
        {
            "weights gathered instead of outputs": """
class GatherWeights(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, rank, world):
        ctx.rank, ctx.rows = rank, w.shape[0]
        parts = [torch.empty_like(w) for _ in range(world)]
        dist.all_gather(parts, w.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows], None, None


class MyColumnLinear(nn.Module):  # every rank computes the whole output from all the weights
    def __init__(self, linear, rank, world):
        super().__init__()
        rows = torch.arange(linear.out_features).chunk(world)[rank]
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        self.bias = nn.Parameter(linear.bias.detach()[rows].clone())
        self.rank, self.world = rank, world

    def forward(self, x):
        both = torch.cat([self.weight, self.bias[:, None]], 1)
        whole = GatherWeights.apply(both, self.rank, self.world)
        return F.linear(x, whole[:, :-1], whole[:, -1])
""",
            "no allreduce of the input gradient": """
exec(open("course/solutions/06_tensor_and_hybrid.py").read())
AllReduceGrad.backward = staticmethod(lambda ctx, grad: (grad, None))
""",
        },
    ),
    "07_which_strategy": (
        dict(check_cell="import dataclasses", names=set(), whole=("from lightning_par.simulate",)),
        "check_step(my_local_sgd_step_s)",
        {
            "borrowed simulator": "def my_local_sgd_step_s(prof, p, topo, speed):\n"
            "    return scaling_row(prof, p, topo, speed)['step_s']\n",
            "section 5's table looked up": "def my_local_sgd_step_s(prof, p, topo, speed):\n"
            "    return predicted['local_sgd'][p]['step_s']\n",
            "the ring every step": "def my_local_sgd_step_s(prof, p, topo, speed):\n"
            "    link = topo.slowest(p)\n"
            "    ring = 2 * (p - 1) * (link.alpha + link.beta * prof.grad_bytes / p)\n"
            "    return prof.compute_s / speed + ring\n",
        },
    ),
}

#: (notebook, answer) -> what the check's message must say (None: the answer passes).
VERDICTS = {
    ("04_model_parallelism", "solution"): None,
    (
        "04_model_parallelism",
        "borrowed balance_by_cost",
    ): "called lightning_par.split.balance_by_cost",
    ("04_model_parallelism", "equal layer counts"): "fullest",
    ("05_pipelining", "solution"): None,
    ("05_pipelining", "borrowed device_schedule"): "called lightning_par.pipeline.schedules",
    ("05_pipelining", "all forwards first"): "activations at once",
    ("06_tensor_and_hybrid", "solution"): None,
    ("06_tensor_and_hybrid", "weights gathered instead of outputs"): "collectives per step",
    ("06_tensor_and_hybrid", "no allreduce of the input gradient"): "Tensor-likes are not close",
    ("07_which_strategy", "solution"): None,
    ("07_which_strategy", "borrowed simulator"): "called lightning_par.simulate",
    ("07_which_strategy", "section 5's table looked up"): "your function raised KeyError",
    ("07_which_strategy", "the ring every step"): "simulator",
}

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
