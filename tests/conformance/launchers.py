"""Launch fixtures: the environment each real launcher gives a rank, and nothing more.

Each builder sets exactly the variables its launcher's documentation lists, so a strategy
that reads one the launcher does not set fails here as it would on a cluster:

* ``srun`` (a job step): the "OUTPUT ENVIRONMENT VARIABLES" section of the srun manual,
  https://slurm.schedmd.com/srun.html#SECTION_OUTPUT-ENVIRONMENT-VARIABLES. ``srun`` sets
  no ``MASTER_ADDR``/``MASTER_PORT``: Lightning's ``SLURMEnvironment``
  (``lightning/fabric/plugins/environments/slurm.py``, ``main_port``) derives the port as
  15000 + the last four digits of ``SLURM_JOB_ID`` and the address from the first host of
  ``SLURM_NODELIST``. Variables only a real ``slurmd`` can know (``SLURM_TASK_PID``,
  ``SLURM_SRUN_COMM_PORT``, ``SLURM_STEP_LAUNCHER_PORT``) are left out; no strategy reads
  them.
* ``salloc`` then the script run in its shell (no job step): the same section of the
  salloc manual, https://slurm.schedmd.com/salloc.html#SECTION_OUTPUT-ENVIRONMENT-VARIABLES:
  the allocation's variables, no ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NODEID``/step.
  Lightning treats the job names ``bash`` and ``interactive`` as "no srun": it starts the
  ranks itself (``_is_slurm_interactive_mode`` in the same file).
* torchrun (static and c10d rendezvous) is the real launcher
  (``python -m torch.distributed.run``, ``torch/distributed/run.py``): its agents set
  ``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``
  (https://pytorch.org/docs/stable/elastic/run.html#environment-variables).
* Lightning's own launch (fork, forkserver, popen): the real launcher, from a script.

On one machine the "nodes" are the loopback addresses 127.0.0.1, 127.0.0.2, ... written in
SLURM's bracket notation (``127.0.0.[1-2]``), which Lightning resolves to the first.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_par.launch.processes import kill_tree
from lightning_par.strategies.registry import strategy_specs

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
SCRIPT = TESTS / "every_launch_script.py"
ALL = [s.name for s in strategy_specs()]
SERVERS = ["parameter_server", "async_sgd"]
ATOL = 1e-5


#: Seconds a strategy that starts its own server processes adds: ``fit``, ``validate`` and
#: ``test`` each start them anew, and under a forkserver launch each rank's servers come from
#: a nested forkserver that imports torch and Lightning again (about 30 s a call measured at
#: load 17 on the 2-core machine: 237 s for ``forkserver`` x the 2 server strategies + ring,
#: which the old limit of 210 s killed with every RESULT printed -- the "popen/forkserver
#: flake": a slow launch, not a hang).
SERVER_START_S = 3 * 30
#: At most this many times the unloaded limit on a machine whose cores are oversubscribed.
MAX_LOAD_FACTOR = 3.0


def load_factor() -> float:
    """How oversubscribed the cores are now (1-minute load average per core), between 1 and
    :data:`MAX_LOAD_FACTOR`: the limits stay bounded, yet sized for other tests running."""
    per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    return min(MAX_LOAD_FACTOR, max(1.0, per_core))


def limit_for(names: list[str], world: int = 2) -> float:
    """Seconds for a launch: interpreters start, then each strategy (2-10 s unloaded at
    world 2; more processes than cores take longer per strategy; the server strategies
    start their servers at each Trainer call), times :func:`load_factor`."""
    servers = sum(name in SERVERS for name in names)
    return (120 + 15 * world * len(names) + SERVER_START_S * servers) * load_factor()


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without any launcher's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LIGHTNING_PAR_S"))}
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "NODE_RANK",
                "GROUP_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):  # fmt: skip
        env.pop(key, None)  # (a launch inside the test process must not leak into these)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    # A group's rendezvous waits for its slowest process, which beside a full CI run on 2
    # cores may be starved for a while; a hang still ends at the test's own limit
    # (limit_for), which names the command.
    env["LIGHTNING_PAR_TIMEOUT"] = "60"
    env["PYTHONUNBUFFERED"] = "1"
    return {**env, **(extra or {})}


def fork_script_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a script that asks for fork launches and fits more than once: with a GPU
    visible, the first backward pass starts autograd's device threads, after which torch
    fails any backward in a forked child, so the next fork launch is refused (``LaunchError``,
    :mod:`lightning_par.launch.policy`). Such a script trains on CPU; it runs as a CPU user's
    would, with the GPUs hidden (nothing changes on a machine without one)."""
    return {**env, "CUDA_VISIBLE_DEVICES": ""}


# ---- SLURM ------------------------------------------------------------------------------------
def slurm_port(job: str) -> int:
    """The port Lightning's ``SLURMEnvironment.main_port`` derives from a job id."""
    return 15000 + int(job[-4:])


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_job_id() -> str:
    """A job id whose derived port is free on this machine now (real job ids are unique
    per cluster; here other tests share the machine)."""
    for _ in range(200):
        job = str(random.randrange(10**6, 10**7))
        if _port_free(slurm_port(job)):
            return job
    raise RuntimeError("no SLURM job id with a free derived port in 200 tries")


def nodelist(nodes: int) -> str:
    return "127.0.0.1" if nodes == 1 else f"127.0.0.[1-{nodes}]"


def _per_node(count: int, nodes: int) -> str:
    """SLURM's compressed per-node count, e.g. ``2(x3)``."""
    return str(count) if nodes == 1 else f"{count}(x{nodes})"


def _allocation(job: str, nodes: int, per_node: int, name: str) -> dict[str, str]:
    """What ``salloc``/``sbatch --nodes=N --ntasks-per-node=T`` put in the job's shell."""
    tasks = nodes * per_node
    return {
        "SLURM_JOB_ID": job, "SLURM_JOBID": job, "SLURM_JOB_NAME": name,
        "SLURM_JOB_NODELIST": nodelist(nodes), "SLURM_NODELIST": nodelist(nodes),
        "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NNODES": str(nodes),
        "SLURM_NTASKS": str(tasks), "SLURM_NPROCS": str(tasks),
        "SLURM_NTASKS_PER_NODE": str(per_node), "SLURM_TASKS_PER_NODE": _per_node(per_node, nodes),
        "SLURM_JOB_CPUS_PER_NODE": _per_node(2, nodes), "SLURM_CPUS_ON_NODE": "2",
        "SLURM_CLUSTER_NAME": "conformance", "SLURM_JOB_PARTITION": "cpu",
        "SLURM_SUBMIT_DIR": os.getcwd(), "SLURM_SUBMIT_HOST": "127.0.0.1",
    }  # fmt: skip


def srun_env(job: str, procid: int, nodes: int, per_node: int) -> dict[str, str]:
    """Task ``procid`` of ``srun --nodes=N --ntasks-per-node=T python script.py`` inside a
    batch job (block distribution: tasks 0..T-1 on the first node). No ``MASTER_*``."""
    node, local = divmod(procid, per_node)
    tasks = nodes * per_node
    step = {
        "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node),
        "SLURM_GTIDS": ",".join(str(node * per_node + i) for i in range(per_node)),
        "SLURM_STEP_NODELIST": nodelist(nodes), "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_STEP_NUM_TASKS": str(tasks), "SLURM_STEP_TASKS_PER_NODE": _per_node(per_node, nodes),
        "SLURM_TOPOLOGY_ADDR": f"127.0.0.{node + 1}", "SLURMD_NODENAME": f"127.0.0.{node + 1}",
        "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1", "SLURM_SRUN_COMM_HOST": "127.0.0.1",
        "SLURM_DISTRIBUTION": "block", "SLURM_PRIO_PROCESS": "0", "SLURM_UMASK": "0022",
    }  # fmt: skip
    return clean_env({**_allocation(job, nodes, per_node, "train.sh"), **step})


def salloc_env(job: str, nodes: int, per_node: int) -> dict[str, str]:
    """The shell of ``salloc --nodes=N --ntasks-per-node=T`` (job name ``interactive``):
    the script runs there directly, Lightning starts the ranks."""
    return clean_env(_allocation(job, nodes, per_node, "interactive"))


# ---- commands ---------------------------------------------------------------------------------
def python(args: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """``python every_launch_script.py ARGS`` in ``env``."""
    return [sys.executable, str(SCRIPT), *args], env


def torchrun_static(node: int, port: int, nodes: int, per_node: int, names: list[str]):
    """One torchrun agent of ``nodes`` with the static rendezvous (``--node-rank``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
           f"--nproc-per-node={per_node}", f"--node-rank={node}", "--master-addr=127.0.0.1",
           f"--master-port={port}", str(SCRIPT), str(per_node), str(nodes), *names]  # fmt: skip
    return cmd, clean_env()


def torchrun_c10d(run_id: str, port: int, nodes: int, per_node: int, names: list[str]):
    """One torchrun agent with the c10d rendezvous: torchrun assigns the node ranks itself
    (``--node-rank`` is ignored there, pytorch/pytorch#150660)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
           f"--nproc-per-node={per_node}", "--rdzv-backend=c10d", f"--rdzv-id={run_id}",
           f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-conf=join_timeout=60",
           str(SCRIPT), str(per_node), str(nodes), *names]  # fmt: skip
    return cmd, clean_env()


# ---- running and reading --------------------------------------------------------------------
def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, 9)
    except OSError:
        pass


def run_all(
    commands: list[tuple[list[str], dict[str, str]]], cwd: Path, limit: float, ok: bool = True
) -> list[str]:
    """Start every command in its own session; kill every group after ``limit`` seconds,
    naming the command that hung; each must exit 0 (``ok``) or not (``ok=False``). Their
    ``TMPDIR`` (unless given) is ``cwd/tmp``, which goes with the test's folder: torchrun's
    agent leaves its ``torchelastic_*`` log folder behind."""
    private_tmp = cwd / "tmp"
    private_tmp.mkdir(exist_ok=True)
    procs = [
        subprocess.Popen(cmd, cwd=cwd, env=_private_tmp(env, private_tmp),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
        for cmd, env in commands
    ]  # fmt: skip
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
                load = os.getloadavg()[0]
                pytest.fail(f"`{' '.join(commands[i][0])}` hung for {limit:.0f} s (killed; load "
                            f"average {load:.1f} on {os.cpu_count()} cores):\n"
                            + outputs[i][-3000:])  # fmt: skip
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
                _killpg(p.pid)
                p.wait()
    for (cmd, _), proc in zip(commands, procs):
        if (proc.returncode == 0) != ok:
            pytest.fail(_every_ending(commands, procs, outputs, cmd))
    return outputs


def _private_tmp(env: dict[str, str], private: Path) -> dict[str, str]:
    """``env`` with ``TMPDIR`` set to ``private``, unless the test chose one itself."""
    if env.get("TMPDIR") not in (None, os.environ.get("TMPDIR")):
        return env
    return {**env, "TMPDIR": str(private)}


def _every_ending(commands: list, procs: list, outputs: list[str], failed: list[str]) -> str:
    """What each command printed last, the one that ``failed`` the test first: the root
    cause of a job of two agents is often in the other agent's output (one rank times out,
    its peers then read "Connection closed by peer")."""
    ordered = sorted(range(len(procs)), key=lambda i: commands[i][0] is not failed)
    return "\n\n".join(
        f"`{' '.join(commands[i][0])}` exited {procs[i].returncode}:\n"
        + _unnested(outputs[i])[-(4000 if commands[i][0] is failed else 2500) :]
        for i in ordered
    )


def _unnested(output: str) -> str:
    """``output`` with torch's rank prefixes said once: each ``init_process_group`` of a
    script wraps ``sys.excepthook`` again, so the traceback of the 13th group prints
    ``[rank0]: `` thirteen times on every line."""
    return re.sub(r"(\[rank\d+\]: )+", r"\1", output)


def results(outputs: list[str]) -> list[dict]:
    """The ``RESULT {json}`` lines of ``every_launch_script.py``."""
    return [
        json.loads(line[len("RESULT ") :])
        for out in outputs
        for line in out.splitlines()
        if line.startswith("RESULT ")
    ]


def check(found: list[dict], names: list[str], ranks: list[int], environment: str) -> None:
    """Each strategy reported from each of ``ranks``, trained its steps (where the rank itself
    reports), matched one process (rank 0), and evaluated after fitting without changing
    any rank's weights (as Lightning's ``run_model_test`` checks,
    ``tests/tests_pytorch/helpers/pipelines.py``)."""
    for name in names:
        rows = {r["rank"]: r for r in found if r["strategy"] == name}
        assert sorted(rows) == ranks, f"{name}: reports from ranks {sorted(rows)}, not {ranks}"
        for r in rows.values():
            assert r["environment"] == environment, (name, r)
            assert r["val"] == r["val"] and r["test"] == r["test"], (name, r)  # not NaN
            assert r["eval_changed"] == 0, f"{name}: validate/test changed the weights: {r}"
            if r["launch"] not in ("fork", "forkserver"):  # (the main process of a fork
                assert r["step"] == r["steps"], (name, r)  # launch gets rank 0's weights)
        zero = rows[0]
        assert zero["moved"] > 1e-3, f"{name}: the weights did not change: {zero}"
        if zero["exact"]:
            assert zero["diff"] < ATOL, f"{name}: max |w - w_one_process| = {zero['diff']:.2e}"


def servers_started(found: list[dict], name: str) -> dict[int, list[int]]:
    """Which servers each rank of a parameter-server strategy started."""
    return {r["rank"]: r["servers_started"] for r in found if r["strategy"] == name}
