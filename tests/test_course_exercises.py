"""Each course exercise's check, run on the wrong answers it must refuse and on the model
answer it must accept: a check that passes a wrong or borrowed answer grades nothing.

The checks are the notebooks' own cells: a program made of the notebook's first code cell,
the cells that define what the check needs, the exercise cells replaced by the model answer
(as the course's test run does) and the check cell itself (which must then pass), followed by
the wrong answers, each run through the same check in a fresh process."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
COURSE = ROOT / "course"


def _source(cell: dict) -> str:
    source = cell["source"]
    text = "".join(source) if isinstance(source, list) else source
    return "\n".join(line for line in text.splitlines() if not line.startswith("%"))


def _defines(source: str) -> set[str]:
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        for target in getattr(node, "targets", []):
            names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def _program(stem: str, wanted: set[str], then: str) -> str:
    """The notebook's first code cell, then in order every code cell defining a name in
    ``wanted`` and every exercise cell (replaced by the model answer), then ``then``."""
    cells = [c for c in json.loads((COURSE / f"{stem}.ipynb").read_text())["cells"]
             if c["cell_type"] == "code"]  # fmt: skip
    answer = (COURSE / "solutions" / f"{stem}.py").read_text()
    parts, found = [], set()
    for i, cell in enumerate(cells):
        source = _source(cell)
        if "exercise" in cell["metadata"].get("tags", []):
            parts.append(answer)
        elif i == 0 or _defines(source) & wanted:
            parts.append(source)
            found |= _defines(source)
    assert wanted <= found, f"{stem}: no cell defines {sorted(wanted - found)}"
    return "\n\n".join([*parts, REFUSED, then])


#: Runs a wrong answer through a check: the first line of the assertion that refused it, or
#: None when the check let it pass.
REFUSED = """
import json as _json


def refused(check, *args):
    try:
        check(*args)
    except AssertionError as error:
        return (str(error) or "assertion failed").splitlines()[0]
    return None
"""


def _run(stem: str, wanted: set[str], then: str, timeout: int = 600) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{COURSE}",
        "MPLBACKEND": "Agg",
        "LIGHTNING_PAR_COURSE_SOLUTIONS": "1",
        "LIGHTNING_PAR_START_METHOD": "fork",  # as in a notebook: no script to re-run
    }
    run = subprocess.run([sys.executable, "-c", _program(stem, wanted, then)], cwd=COURSE,
                         env=env, capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "): correct." in run.stdout, "the check cell did not accept the model answer"
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_00_parallel_sgd_check_refuses_a_step_without_workers():
    found = _run(
        "00_sgd_and_parallelism",
        {"gradient", "check_parallel_sgd"},
        """
def no_workers(w, shards, lr, grad):  # one step on the whole batch: the same numbers
    return w - lr * grad(w, torch.cat(shards))


def whole_batch_each(w, shards, lr, grad):
    return torch.stack([w - lr * grad(w, torch.cat(shards)) for _ in shards]).mean(0)


def in_place(w, shards, lr, grad):
    w -= lr * sum(grad(w, s) for s in shards) / len(shards)
    return w


def summed(w, shards, lr, grad):
    return sum(w - lr * grad(w, s) for s in shards)


print(_json.dumps({name: refused(check_parallel_sgd, fn) for name, fn in [
    ("no workers", no_workers), ("every worker on the whole batch", whole_batch_each),
    ("w changed in place", in_place), ("weights summed", summed),
    ("model answer", parallel_sgd_step)]}))
""",
    )
    assert found.pop("model answer") is None
    assert "grad asked 1 time(s), on [64] samples" in found["no workers"]
    assert all(found.values()), found


def test_02_link_bytes_check_refuses_the_borrowed_plan_and_wrong_counts():
    found = _run(
        "02_parameter_server",
        {"make", "fit", "link_runs", "check_link_bytes"},
        """
from lightning_par.paramserver.plan import plan_shards


def borrowed(numels, element_size, workers, servers, split_bytes):  # right numbers, not written
    plan = plan_shards(numels, [element_size] * len(numels), servers, split_bytes)
    return [2 * workers * b for b in plan.server_bytes()]


def push_only(*args):
    return [b // 2 for b in my_server_link_bytes(*args)]


def no_sharding(numels, element_size, workers, servers, split_bytes):
    return [2 * workers * element_size * sum(numels)] * servers


def never_split(numels, element_size, workers, servers, split_bytes):
    return my_server_link_bytes(numels, element_size, workers, servers, 10**12)


right = {run: borrowed(numels, 4, run[0], run[1], int(run[2] * 2**20)) for run in link_runs}
assert right == link_runs  # the plan's numbers are the traces': only borrowing is refused
print(_json.dumps({name: refused(check_link_bytes, fn, link_runs) for name, fn in [
    ("borrowed plan_shards", borrowed), ("push only", push_only), ("no sharding", no_sharding),
    ("never split", never_split), ("model answer", my_server_link_bytes)]}))
""",
    )
    assert found.pop("model answer") is None
    assert "called lightning_par.paramserver.plan.plan_shards" in found["borrowed plan_shards"]
    assert all(found.values()), found


def test_03a_remedies_check_refuses_the_library_and_wrong_rules():
    found = _run(
        "03_async_sgd",
        {"check_remedies"},
        """
from lightning_par.paramserver import remedies


def in_place(grad, weights, read, lam):
    return grad.add_(lam * grad * grad * (weights - read))


wrong = {
    "borrowed staleness_scale": (lambda lr, tau: lr * remedies.staleness_scale(tau), dc_gradient),
    "borrowed compensate": (staleness_aware_lr, remedies.compensate),
    "multiply by the staleness": (lambda lr, tau: lr * max(1, tau), dc_gradient),
    "staleness ignored": (lambda lr, tau: lr, dc_gradient),
    "plain division": (lambda lr, tau: lr / (tau + 1), dc_gradient),
    "sign flipped": (staleness_aware_lr, lambda g, w, read, lam: dc_gradient(g, read, w, lam)),
    "no compensation": (staleness_aware_lr, lambda g, w, read, lam: g.clone()),
    "lambda left out": (staleness_aware_lr, lambda g, w, read, lam: dc_gradient(g, w, read, 1.0)),
    "grad changed in place": (staleness_aware_lr, in_place),
    "model answer": (staleness_aware_lr, dc_gradient),
}
print(_json.dumps({name: refused(check_remedies, *fns) for name, fns in wrong.items()}))
""",
    )
    assert found.pop("model answer") is None
    for name in ("borrowed staleness_scale", "borrowed compensate"):
        assert "called lightning_par.paramserver.remedies" in found[name]
    assert all(found.values()), found


@pytest.mark.timeout(900)
def test_03b_strategy_check_refuses_unsynchronised_buffers():
    found = _run(
        "03_async_sgd",
        {"IMAGES", "my_ring_allreduce", "check_remedies", "check_my_strategy"},
        """
class ParametersOnly(MyRingStrategy):  # buffers left as each process made them
    def sync_model_states(self):
        with torch.no_grad():
            for p in self.model.parameters():
                dist.broadcast(p.data, src=0)


class OwnStart(MyRingStrategy):
    def sync_model_states(self):
        pass


print(_json.dumps({name: refused(check_my_strategy, lambda: cls(CAP)) for name, cls in [
    ("buffers left unsynchronised", ParametersOnly), ("each process its own start", OwnStart)]}))
""",
        timeout=900,
    )
    assert (
        "buffer elements (BatchNorm's running statistics) differ"
        in found["buffers left unsynchronised"]
    )
    assert all(found.values()), found
