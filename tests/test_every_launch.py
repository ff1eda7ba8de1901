"""Every registered strategy under every launch a user has, from a script in a fresh
interpreter: fork, forkserver, popen (the GPU default), torchrun on one node, two torchrun
agents as two nodes on 127.0.0.1, a SLURM job step (the variables ``srun`` sets, one process
per task started here) and an interactive SLURM allocation (Lightning starts the ranks).

One script invocation per launch trains its strategies in turn (``every_launch_script.py``:
``fit``, then ``validate`` and ``test`` with the same Trainer), so the interpreters start once
per launch. Each synchronous strategy must give one process's weights; ``async_sgd`` must
train and end cleanly. Every command runs in its own session and the whole group is killed
at the time limit, naming the command that hung; ports are chosen free by the OS.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_par.comm.processes import kill_tree
from lightning_par.comm.rendezvous import find_free_port
from lightning_par.strategies.registry import strategy_specs

SCRIPT = Path(__file__).with_name("every_launch_script.py")
ROOT = Path(__file__).resolve().parents[1]
ALL = [s.name for s in strategy_specs()]
SERVERS = ["parameter_server", "async_sgd"]
ATOL = 1e-5


def limit_for(names: list[str]) -> float:
    """Seconds for a launch (interpreters start, then each strategy: 2-10 s unloaded)."""
    return 120 + 30 * len(names)


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LIGHTNING_PAR_S"))}
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "NODE_RANK"):
        env.pop(key, None)  # (a launch inside the test process must not leak into these)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["LIGHTNING_PAR_TIMEOUT"] = "30"
    env["PYTHONUNBUFFERED"] = "1"
    return {**env, **(extra or {})}


def run_all(commands: list[tuple[list[str], dict[str, str]]], cwd: Path, limit: float) -> list[str]:
    """Start every command in its own session; kill every group after ``limit`` seconds."""
    procs = [
        subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )  # fmt: skip
        for cmd, env in commands
    ]
    outputs = [""] * len(procs)
    deadline = time.monotonic() + limit
    try:
        for i, proc in enumerate(procs):
            try:
                outputs[i], _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for p in procs:
                    kill_tree(p.pid)
                    _killpg(p.pid)
                outputs[i] = proc.communicate()[0]
                pytest.fail(f"`{' '.join(commands[i][0])}` hung for {limit:.0f} s (killed):\n"
                            + outputs[i][-3000:])  # fmt: skip
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
                _killpg(p.pid)
                p.wait()
    for (cmd, _), proc, out in zip(commands, procs, outputs):
        assert proc.returncode == 0, f"`{' '.join(cmd)}` exited {proc.returncode}:\n{out[-4000:]}"
    return outputs


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, 9)
    except OSError:
        pass


def results(outputs: list[str]) -> list[dict]:
    return [
        json.loads(line[len("RESULT ") :])
        for out in outputs
        for line in out.splitlines()
        if line.startswith("RESULT ")
    ]


def check(found: list[dict], names: list[str], ranks: list[int], environment: str) -> None:
    """Each strategy reported from each of ``ranks``, trained 3 steps (where the rank itself
    reports), matched one process (rank 0), and evaluated after fitting."""
    for name in names:
        rows = {r["rank"]: r for r in found if r["strategy"] == name}
        assert sorted(rows) == ranks, f"{name}: reports from ranks {sorted(rows)}, not {ranks}"
        for r in rows.values():
            assert r["environment"] == environment, (name, r)
            assert r["val"] == r["val"] and r["test"] == r["test"], (name, r)  # not NaN
            if r["launch"] not in ("fork", "forkserver"):  # (the main process of a fork
                assert r["step"] == 3, (name, r)  # launch gets rank 0's weights only)
        zero = rows[0]
        assert zero["moved"] > 1e-3, f"{name}: the weights did not change: {zero}"
        if zero["exact"]:
            assert zero["diff"] < ATOL, f"{name}: max |w - w_one_process| = {zero['diff']:.2e}"


def _python(args: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    return [sys.executable, str(SCRIPT), *args], env


def _torchrun(node: int, port: int, nodes: int, per_node: int, names: list[str]):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
           f"--nproc-per-node={per_node}", f"--node-rank={node}", "--master-addr=127.0.0.1",
           f"--master-port={port}", str(SCRIPT), str(per_node), str(nodes), *names]  # fmt: skip
    return cmd, _env()


@pytest.mark.parametrize(
    "method, names",
    [("popen", ALL), ("fork", ALL), ("forkserver", [*SERVERS, "ring_allreduce"])],
)
def test_every_strategy_from_a_script(tmp_path, method, names):
    env = _env({"LIGHTNING_PAR_START_METHOD": method})
    out = run_all([_python(["2", "1", *names], env)], tmp_path, limit=limit_for(names))
    found = results(out)
    ranks = [0, 1] if method == "popen" else [0]  # (a fork launch: the main process reports)
    check(found, names, ranks, "LightningEnvironment")
    assert all(r["launch"] in (method, None) for r in found), found


def test_every_strategy_under_two_torchrun_agents_as_two_nodes(tmp_path):
    port = find_free_port()
    commands = [_torchrun(node, port, 2, 1, ALL) for node in (0, 1)]
    found = results(run_all(commands, tmp_path, limit=limit_for(ALL)))
    check(found, ALL, [0, 1], "TorchElasticEnvironment")
    for name in SERVERS:  # ps-lite's server role: each node starts its share
        started = {r["rank"]: r["servers_started"] for r in found if r["strategy"] == name}
        assert started == {0: [0], 1: [1]}, (name, started)


def test_server_strategies_under_torchrun_on_one_node(tmp_path):
    names = [*SERVERS, "lightning_ddp"]
    command = _torchrun(0, find_free_port(), 1, 2, names)
    found = results(run_all([command], tmp_path, limit_for(names)))
    check(found, names, [0, 1], "TorchElasticEnvironment")


def _slurm(rank: int, tasks: int, job: str, port: int) -> dict[str, str]:
    """What ``srun --ntasks-per-node=2`` sets for task ``rank`` of a one-node job step."""
    return _env({
        "SLURM_JOB_ID": job, "SLURM_JOB_NAME": "train.sh", "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": str(tasks), "SLURM_NTASKS_PER_NODE": str(tasks), "SLURM_NNODES": "1",
        "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0",
        "SLURM_NODELIST": "127.0.0.1", "SLURM_JOB_NODELIST": "127.0.0.1",
        "SLURM_CPUS_ON_NODE": "2", "SLURM_STEP_NUM_TASKS": str(tasks),
        "MASTER_PORT": str(port),  # (else Lightning derives it from the job id)
    })  # fmt: skip


def test_server_strategies_under_a_slurm_job_step(tmp_path):
    names = [*SERVERS, "ring_allreduce", "gpipe"]
    job, port = str(random.randrange(10**6, 10**7)), find_free_port()
    commands = [_python(["2", "1", *names], _slurm(rank, 2, job, port)) for rank in (0, 1)]
    found = results(run_all(commands, tmp_path, limit=limit_for(names)))
    check(found, names, [0, 1], "SLURMEnvironment")
    for name in SERVERS:  # one node: its local rank 0 starts both servers
        started = {r["rank"]: r["servers_started"] for r in found if r["strategy"] == name}
        assert started == {0: [0, 1], 1: []}, (name, started)


def test_an_interactive_slurm_allocation_lets_lightning_start_the_ranks(tmp_path):
    env = _slurm(0, 2, "4242", find_free_port())
    for key in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_ID", "MASTER_PORT"):
        env.pop(key)
    env["SLURM_JOB_NAME"] = "interactive"  # `salloc` then `srun --pty bash`, or a notebook
    command = _python(["2", "1", *SERVERS], env)
    found = results(run_all([command], tmp_path, limit=limit_for(SERVERS)))
    check(found, SERVERS, [0], "LightningEnvironment")
    assert all(r["launch"] == "fork" for r in found), found  # Lightning started them
