"""Runs ``flow.py`` the way users run a script and compares it with one process.

``run_flow`` starts ``python flow.py STRATEGY NETWORK OUT`` (or under ``torchrun``, or in a
Jupyter kernel) in a fresh folder with the environment a user has: nothing of this test
session's (no ``LIGHTNING_PAR_TIMEOUT``, no launcher variables), the process group killed
after a deadline. ``compare`` checks every figure against ``flow.py one`` on the same data
read the same way, and returns what differs (empty: the strategy passed the flow).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from lightning_par.launch.processes import run_bounded

FLOW = Path(__file__).with_name("flow.py")
GLOBAL_BATCH = 16
STEPS_PER_EPOCH = 64 // GLOBAL_BATCH
#: Strategies each of whose ranks reads its own shard of every batch (the rest: every rank
#: reads the whole batch); hybrid's rows do, over its data-parallel size.
DATA_PARALLEL = ("_allreduce", "parameter_server", "async_sgd", "local_sgd", "zero",
                 "lightning_ddp")  # fmt: skip
#: Not equal to one process by design: compared for the flow itself, not the weights.
NOT_SYNCHRONOUS = ("async_sgd", "local_sgd")
#: Launcher variables a test session may hold that a user's shell does not.
SESSION_ONLY = ("LIGHTNING_PAR_TIMEOUT", "LIGHTNING_PAR_START_METHOD", "LOCAL_RANK", "RANK",
                "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GROUP_RANK",
                "PL_GLOBAL_SEED", "PL_SEED_WORKERS")  # fmt: skip


@dataclass(frozen=True)
class Case:
    """One cell of the grid: a strategy, a network and how the script is started."""

    strategy: str
    network: str
    launch: str = "fork"  # "fork", "popen" (start_method), "torchrun" or "notebook"

    @property
    def devices(self) -> int:
        return 4 if self.strategy == "hybrid" else 2

    @property
    def replicas(self) -> int:
        """Data-parallel size: how many ranks read different samples."""
        if self.strategy == "hybrid":
            return 2
        return self.devices if self.strategy.endswith(DATA_PARALLEL) else 1

    @property
    def name(self) -> str:
        return f"{self.strategy}-{self.network}-{self.launch}"


def user_environment(folder: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SESSION_ONLY}
    env["TMPDIR"] = str(folder / "tmp")
    (folder / "tmp").mkdir(exist_ok=True)
    # the checkout first, as in a virtual environment with the project installed
    env["PYTHONPATH"] = os.pathsep.join([str(FLOW.parents[2]), *sys.path])
    return env


def _command(case: Case, out: Path) -> list[str]:
    args = [case.strategy, case.network, str(out), "--devices", str(case.devices),
            "--batch", str(GLOBAL_BATCH // case.replicas)]  # fmt: skip
    if case.launch == "popen":
        args += ["--start-method", "popen"]
    if case.launch == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={case.devices}", str(FLOW), *args]  # fmt: skip
    if case.launch == "notebook":
        return [sys.executable, str(FLOW.with_name("in_kernel.py")), *args]
    return [sys.executable, str(FLOW), *args]


def run_flow(case: Case, folder: Path, timeout: float = 260) -> tuple[dict, str]:
    """Run the script for ``case`` in ``folder``; its result and its output."""
    folder.mkdir(parents=True, exist_ok=True)
    env = user_environment(folder)
    proc = run_bounded(_command(case, folder), timeout, cwd=folder, env=env)
    text = proc.stdout + proc.stderr
    # torch's own: the compiler's cache, and torchrun's log folder (its agent keeps it)
    theirs = ("torchinductor", "torchelastic_")
    left = [p.name for p in (folder / "tmp").iterdir() if not p.name.startswith(theirs)]
    result_file = folder / "result.pt"
    if not result_file.exists():
        why = "timed out" if proc.timed_out else f"exit code {proc.returncode}"
        return {"reached": "nothing", "error": f"no result ({why})"}, text
    result = torch.load(result_file, weights_only=False)
    result["returncode"], result["temporary_files_left"] = proc.returncode, left
    return result, text


@cache
def baseline(network: str, replicas: int, folder: str) -> dict:
    """``flow.py one``: one process reading what ``replicas`` ranks read together."""
    out = Path(folder) / f"one-{network}-{replicas}"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(FLOW), "one", network, str(out), "--batch", str(GLOBAL_BATCH),
           "--replicas", str(replicas)]  # fmt: skip
    proc = run_bounded(cmd, 300, cwd=out, env=user_environment(out))
    assert (out / "result.pt").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = torch.load(out / "result.pt", weights_only=False)
    assert result["reached"] == "done", result.get("traceback")
    return result


def _max_difference(got: dict, want: dict) -> float:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return max((got[k].double() - want[k].double()).abs().max().item() for k in want)


def _close(got: dict, want: dict) -> bool:
    return all(torch.allclose(got[k].double(), want[k].double(), rtol=1e-4, atol=2e-5)
               for k in want)  # fmt: skip


def compare(case: Case, got: dict, want: dict) -> list[str]:
    """What differs between the strategy's run and one process's (empty: none)."""
    if got["reached"] != "done":
        return [f"stopped at {got['reached']}: {got.get('error')}\n{got.get('traceback', '')}"]
    problems = []
    if got.get("returncode"):
        problems.append(f"exit code {got['returncode']}")
    if got["temporary_files_left"]:
        problems.append(f"temporary files left: {got['temporary_files_left']}")
    if got["loaded_type"] != "Net":
        problems.append(f"load_from_checkpoint gave a {got['loaded_type']}")
    if not _close(got["loaded"], got["fit"]):
        problems.append(f"loaded != fitted weights by {_max_difference(got['loaded'], got['fit'])}")
    states = got["saved_optimizer"]
    if len(states) != 1 or len(states[0]["state"]) != len(want["saved_optimizer"][0]["state"]):
        problems.append("the checkpoint saved after fit lacks the optimiser state")
    steps = (got["saved_step"], got["resumed_step"])
    if case.strategy == "async_sgd":  # each worker counts the shared batches it trained
        steps = (STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH) if 0 < steps[0] < steps[1] else steps
    if steps != (STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH):
        problems.append(f"global steps saved {got['saved_step']}, after resume "
                        f"{got['resumed_step']}")  # fmt: skip
    if case.launch in ("fork", "notebook") and not _close(got["script_model"], got["fit"]):
        problems.append("the script's model after a fork's fit is not the saved model")
    if case.strategy in NOT_SYNCHRONOUS:
        return problems
    for key in ("fit", "resumed"):
        if not _close(got[key], want[key]):
            problems.append(f"{key} weights differ from one process's by "
                            f"{_max_difference(got[key], want[key]):.3g}")  # fmt: skip
    for key in ("validate", "test"):
        if abs(got[key] - want[key]) > 1e-4 * max(1.0, abs(want[key])):
            problems.append(f"{key} loss {got[key]:.6f} against one process's {want[key]:.6f}")
    if got["predict"] is not None:  # (Lightning's fork launchers return none to the script)
        for i, row in got["predict"].items():
            if not torch.allclose(row, want["predict"][i], rtol=1e-4, atol=2e-5):
                problems.append(f"prediction of sample {i} differs")
                break
    return problems


def summary(case: Case, problems: list[str]) -> str:
    return json.dumps({"case": case.name, "ok": not problems, "problems": problems})
