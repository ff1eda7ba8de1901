"""The exercise checks of notebooks 04-09 reject the wrong answers a student can give (the
helper the notebook imports, borrowed; the weights gathered instead of the outputs; a number
looked up in the notebook's own table; the optimizer state left whole; the loss divided by the
new world size) and accept the model answer in ``course/solutions/``.

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
    "08_zero": (
        dict(check_cell="from exercise import checking", names=set()),
        "check_zero_one(MyZeroOne)",
        {
            "optimizer state not sharded": """
class MyZeroOne:  # the two phases make an allreduce; every rank steps every parameter
    def __init__(self, model, make_optimizer, reduce_scatter, all_gather):
        self.params = list(model.parameters())
        self.optimizer = make_optimizer(self.params)
        self.reduce_scatter, self.all_gather = reduce_scatter, all_gather

    def step(self):
        p, n = dist.get_world_size(), sum(q.numel() for q in self.params)
        flat = torch.zeros(p * -(-n // p))
        flat[:n] = torch.cat([q.grad.flatten() for q in self.params])
        self.reduce_scatter(flat)
        self.all_gather(flat)
        start = 0
        for q in self.params:
            q.grad.copy_(flat[start : start + q.numel()].view_as(q) / p)
            start += q.numel()
        self.optimizer.step()
""",
            "optimizer over the whole flat vector": """
exec(open("course/solutions/08_zero.py").read())
_Sliced = MyZeroOne


class MyZeroOne(_Sliced):  # state for p * S elements, the gradient zero outside the slice
    def __init__(self, model, make_optimizer, reduce_scatter, all_gather):
        super().__init__(model, lambda params: None, reduce_scatter, all_gather)
        self.whole = nn.Parameter(self._flat([q.detach() for q in self.params]))
        self.optimizer = make_optimizer([self.whole])

    def step(self):
        mine = self.reduce_scatter(self._flat([q.grad for q in self.params]))
        self.whole.grad = torch.zeros_like(self.whole)
        self.whole.grad[self.lo : self.lo + self.size] = mine / self.world_size
        self.optimizer.step()
        self.slice.data = self.whole.detach()[self.lo : self.lo + self.size].clone()
        weights = torch.zeros(self.world_size * self.size)
        weights[self.lo : self.lo + self.size] = self.slice.detach()
        self.all_gather(weights)
        start = 0
        with torch.no_grad():
            for q in self.params:
                q.copy_(weights[start : start + q.numel()].view_as(q))
                start += q.numel()
""",
            "all-gather forgotten": """
exec(open("course/solutions/08_zero.py").read())
_Answer = MyZeroOne
MyZeroOne = lambda model, make, rs, ag: _Answer(model, make, rs, lambda flat: flat)
""",
            "the sum taken as the mean (no 1/p)": """
exec(open("course/solutions/08_zero.py").read())
_Answer = MyZeroOne
MyZeroOne = lambda model, make, rs, ag: _Answer(
    model, make, lambda flat: rs(flat).mul_(dist.get_world_size()), ag)
""",
            "borrowed FlatUnit": """
from torch import nn

from lightning_par.zero.units import FlatUnit


class MyZeroOne:  # the library's flat unit lays out and shards the parameters
    def __init__(self, model, make_optimizer, reduce_scatter, all_gather):
        self.params = list(model.parameters())
        self.p = dist.get_world_size()
        self.unit = FlatUnit(0, self.params, self.p, dist.get_rank())
        self.reduce_scatter, self.all_gather = reduce_scatter, all_gather
        self.slice = nn.Parameter(self.unit.shard.detach().clone())
        self.optimizer = make_optimizer([self.slice])

    def step(self):
        grads = torch.zeros(self.unit.padded_numel)
        for q, start in zip(self.params, self.unit.offsets):
            grads[start : start + q.numel()] = q.grad.reshape(-1)
        self.slice.grad = self.reduce_scatter(grads) / self.p
        self.optimizer.step()
        lo = self.unit.rank * self.unit.shard_numel
        with torch.no_grad():
            self.unit.full[lo : lo + self.unit.shard_numel] = self.slice
        self.all_gather(self.unit.full)  # the parameters are views of it
""",
        },
    ),
    "09_fault_tolerance": (
        dict(
            check_cell="from exercise import checking",
            names={
                "g",
                "ROWS",
                "X_ALL",
                "W_TRUE",
                "Y_ALL",
                "W0",
                "shard_loss",
                "one_process_gradient",
                "survivors_gradient",
                "library_answer",
            },
        ),
        "check_stand_ins(my_stands_in_for, my_loss_scale)",
        {
            "lost shards skipped": "def my_stands_in_for(first_world, survivors, me):\n"
            "    return []\n"
            "def my_loss_scale(first_world, survivors):\n"
            "    return 1.0\n",
            "loss divided by the new world size": "def my_stands_in_for(first_world, survivors, "
            "me):\n"
            "    lost = [r for r in range(first_world) if r not in survivors]\n"
            "    return [r for i, r in enumerate(lost) if survivors[i % len(survivors)] == me]\n"
            "def my_loss_scale(first_world, survivors):\n"
            "    return 1 / len(survivors)\n",
            "no loss scale": "def my_stands_in_for(first_world, survivors, me):\n"
            "    lost = [r for r in range(first_world) if r not in survivors]\n"
            "    return [r for i, r in enumerate(lost) if survivors[i % len(survivors)] == me]\n"
            "def my_loss_scale(first_world, survivors):\n"
            "    return 1.0\n",
            "every lost shard on the first survivor": "def my_stands_in_for(first_world, "
            "survivors, me):\n"
            "    lost = [r for r in range(first_world) if r not in survivors]\n"
            "    return lost if me == survivors[0] else []\n"
            "def my_loss_scale(first_world, survivors):\n"
            "    return len(survivors) / first_world\n",
            "round robin from the last survivor": "def my_stands_in_for(first_world, survivors, "
            "me):\n"
            "    lost = [r for r in range(first_world) if r not in survivors]\n"
            "    order = survivors[::-1]\n"
            "    return [r for i, r in enumerate(lost) if order[i % len(order)] == me]\n"
            "def my_loss_scale(first_world, survivors):\n"
            "    return len(survivors) / first_world\n",
            "borrowed FaultTolerance": "def my_stands_in_for(first_world, survivors, me):\n"
            "    return library_answer(first_world, survivors)[0][me]\n"
            "def my_loss_scale(first_world, survivors):\n"
            "    return library_answer(first_world, survivors)[1]\n",
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
    ("08_zero", "solution"): None,
    ("08_zero", "optimizer state not sharded"): "one optimizer over at most S",
    ("08_zero", "optimizer over the whole flat vector"): "one optimizer over at most S",
    ("08_zero", "all-gather forgotten"): "differ from one process's",
    ("08_zero", "the sum taken as the mean (no 1/p)"): "differ from one process's",
    ("08_zero", "borrowed FlatUnit"): "called lightning_par.zero.units",
    ("09_fault_tolerance", "solution"): None,
    ("09_fault_tolerance", "lost shards skipped"): "differs from one process's gradient",
    ("09_fault_tolerance", "loss divided by the new world size"): "differs from one process's",
    ("09_fault_tolerance", "no loss scale"): "differs from one process's gradient",
    ("09_fault_tolerance", "every lost shard on the first survivor"): "round robin gives at most",
    ("09_fault_tolerance", "round robin from the last survivor"): "round robin deals",
    ("09_fault_tolerance", "borrowed FaultTolerance"): "called lightning_par.components",
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
