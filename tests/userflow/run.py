"""Runs ``flow.py`` the way users run a script and compares it with one process.

``run_flow`` starts ``python flow.py STRATEGY NETWORK OUT`` (or under ``torchrun``, or in a
Jupyter kernel) in a fresh folder with the environment a user has: nothing of this test
session's (no ``LIGHTNING_PAR_TIMEOUT``, no launcher variables), the process group killed
after a deadline. ``compare`` checks every figure against ``flow.py one`` on the same data
read the same way (``baselines``: every one-process run needed, in one interpreter), and
how the launch went in every rank that ran the script, and returns what differs (empty:
the strategy passed the flow).
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from lightning_par.launch.processes import run_bounded

FLOW = Path(__file__).with_name("flow.py")
BASELINES = Path(__file__).with_name("baselines.py")
GLOBAL_BATCH = 16
STEPS_PER_EPOCH = 64 // GLOBAL_BATCH
#: Strategies each of whose ranks reads its own shard of every batch (the rest: every rank
#: reads the whole batch); hybrid's rows do, over its data-parallel size.
DATA_PARALLEL = ("_allreduce", "parameter_server", "async_sgd", "local_sgd", "zero",
                 "lightning_ddp")  # fmt: skip
#: Not equal to one process by design: compared for the flow itself, not the weights.
NOT_SYNCHRONOUS = ("async_sgd", "local_sgd")
#: What Lightning must detect and how the ranks must start, by launch: (cluster environment,
#: start method; ``None``: the ranks existed already).
LAUNCHED_AS = {
    "fork": ("LightningEnvironment", "fork"),
    "popen": ("LightningEnvironment", "popen"),
    "notebook": ("LightningEnvironment", "fork"),  # (a notebook can only fork)
    "torchrun": ("TorchElasticEnvironment", None),
}
#: Launches whose every rank runs the script (and writes ``result-rank<N>.pt``).
EVERY_RANK_RUNS = ("popen", "torchrun")
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
    def start_method(self) -> str | None:
        """The ``start_method`` the script asks for: fork (what a 2-core machine picks) and
        popen (what a many-core one picks) are asked for, so every machine runs both;
        torchrun starts the ranks itself, a notebook can only fork."""
        return self.launch if self.launch in ("fork", "popen") else None

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
    if case.start_method is not None:
        args += ["--start-method", case.start_method]
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
    result["other_ranks"] = {
        int(path.stem.removeprefix("result-rank")): torch.load(path, weights_only=False)
        for path in folder.glob("result-rank*.pt")
    }
    return result, text


def baselines(cases: list[Case], folder: Path) -> dict[tuple[str, int], dict]:
    """``flow.py one`` for each network and data-parallel size of ``cases``: one process
    reading what that many ranks read together. All in one interpreter (``baselines.py``):
    importing torch, Lightning and torchvision is most of a one-process run's time."""
    pairs = sorted({(case.network, case.replicas) for case in cases})
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(BASELINES), str(folder), str(GLOBAL_BATCH),
           *(f"{network}:{replicas}" for network, replicas in pairs)]  # fmt: skip
    proc = run_bounded(cmd, 120 + 120 * len(pairs), cwd=folder, env=user_environment(folder))
    found = {}
    for network, replicas in pairs:
        out = folder / f"one-{network}-{replicas}" / "result.pt"
        assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
        found[network, replicas] = result = torch.load(out, weights_only=False)
        assert result["reached"] == "done", result.get("traceback")
    return found


def _max_difference(got: dict, want: dict) -> float:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return max((got[k].double() - want[k].double()).abs().max().item() for k in want)


def _close(got: dict, want: dict) -> bool:
    return all(torch.allclose(got[k].double(), want[k].double(), rtol=1e-4, atol=2e-5)
               for k in want)  # fmt: skip


def _rank_problems(case: Case, rank: int, got: dict) -> list[str]:
    """In one rank that ran the script: it reached the end, Lightning detected the launch's
    cluster environment, ``fit`` trained one epoch's steps (where the rank itself trained:
    the script of a fork launch counts none), ``validate``/``test`` gave finite losses and,
    with ``predict``, left the weights as ``fit`` left them."""
    if got["reached"] != "done":
        return [f"rank {rank} stopped at {got['reached']}: {got.get('error')}\n"
                f"{got.get('traceback', '')}"]  # fmt: skip
    problems = []
    environment, _ = LAUNCHED_AS[case.launch]
    if got["environment"] != environment:
        problems.append(f"rank {rank}: Lightning detected {got['environment']}, not {environment}")
    if case.launch in EVERY_RANK_RUNS:
        step = got["fit_step"]
        trained = step > 0 if case.strategy == "async_sgd" else step == STEPS_PER_EPOCH
        if not trained:  # (each async_sgd worker counts the shared batches it trained)
            problems.append(f"rank {rank}: fit ended at global step {step}")
    if not all(math.isfinite(got[key]) for key in ("validate", "test")):
        problems.append(f"rank {rank}: validate {got['validate']}, test {got['test']}")
    before, after = got["script_model"], got["after_evaluation"]
    if before.keys() != after.keys() or not all(torch.equal(after[k], before[k]) for k in before):
        problems.append(f"rank {rank}: validate/test/predict changed the weights fit left")
    return problems


def _launch_problems(case: Case, got: dict) -> list[str]:
    """How the launch went: the start method the case names, a result from every rank that
    runs the script, each rank's own checks (:func:`_rank_problems`), the same replica in
    every rank of a synchronous data-parallel strategy, and ``fit`` moved the weights (what
    the strategies not compared with one process must show too)."""
    _, method = LAUNCHED_AS[case.launch]
    problems = [] if got["launch"] == method else [f"started by {got['launch']}, not {method}"]
    others = sorted(got["other_ranks"])
    expected = list(range(1, case.devices)) if case.launch in EVERY_RANK_RUNS else []
    if others != expected:
        problems.append(f"results from ranks {others} besides rank 0, not {expected}")
    for rank, result in [(0, got), *sorted(got["other_ranks"].items())]:
        problems += _rank_problems(case, rank, result)
    if case.replicas == case.devices and case.strategy not in NOT_SYNCHRONOUS:
        for rank, result in got["other_ranks"].items():  # (each rank holds a whole replica)
            replica = result.get("script_model")
            if replica is not None and not _close(replica, got["script_model"]):
                problems.append(f"rank {rank}'s replica differs from rank 0's after fit")
    if not _max_difference(got["fit"], got["initial"]) > 1e-3:
        problems.append("fit left the weights where they started")
    return problems


def compare(case: Case, got: dict, want: dict) -> list[str]:
    """What differs between the strategy's run and one process's (empty: none)."""
    if got["reached"] != "done":
        return [f"stopped at {got['reached']}: {got.get('error')}\n{got.get('traceback', '')}"]
    problems = _launch_problems(case, got)
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
