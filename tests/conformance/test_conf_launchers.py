"""Every registered strategy under each launcher exactly as it starts a job (the fixtures of
:mod:`conformance.launchers`, each written from its launcher's documentation): a SLURM job
step with several nodes and tasks per node (no ``MASTER_*``), an interactive ``salloc``
allocation, torchrun's c10d rendezvous, two torchrun agents as two nodes of two processes
each, and Lightning's forkserver launch from a script. (Lightning's fork and popen launches
from a script, and torchrun on one node, run every strategy through the user's whole flow:
``tests/test_user_flow.py``, which holds each launch to the same checks: the cluster
environment, the start method, every rank to the end with its steps, evaluation that leaves
the weights.)

One script invocation per launch trains its strategies in turn (``every_launch_script.py``:
``fit``, then ``validate`` and ``test`` with the same Trainer), so the interpreters start once
per launch: a strategy more costs a launch little, a launch more costs its interpreters.
Each synchronous strategy must give one process's weights after 3 steps; ``async_sgd`` must
train and end cleanly. ``hybrid``'s default grid (mp=2) puts its model-parallel groups
within a node on 2 nodes x 2 tasks (no warning) and across nodes on 2 nodes x 1 task
(warned, with the reason). Every launch has a time limit that kills its process groups and
names the command; ports are chosen free by the OS.
"""

from __future__ import annotations

import os
import uuid

from conformance.launchers import (
    ALL,
    SERVERS,
    check,
    clean_env,
    free_job_id,
    limit_for,
    python,
    results,
    run_all,
    salloc_env,
    servers_started,
    slurm_port,
    srun_env,
    torchrun_c10d,
    torchrun_static,
)

from lightning_par.launch.rendezvous import find_free_port

ACROSS = "spans nodes"  # (hybrid's warning when its model-parallel groups cross nodes)


def _srun(tmp_path, nodes: int, per_node: int, names: list[str]) -> tuple[list[dict], str]:
    job = free_job_id()
    commands = [
        python([str(per_node), str(nodes), *names], srun_env(job, rank, nodes, per_node))
        for rank in range(nodes * per_node)
    ]
    for _, env in commands:  # what srun does not set, the fixture must not set either
        assert not {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"} & set(env)
    outputs = run_all(commands, tmp_path, limit_for(names, nodes * per_node))
    return results(outputs), outputs[0]


def test_every_strategy_under_srun_two_nodes_one_task_each(tmp_path):
    found, first = _srun(tmp_path, 2, 1, ALL)
    check(found, ALL, [0, 1], "SLURMEnvironment")
    for name in SERVERS:  # ps-lite's server role: each node's local rank 0 starts its share
        assert servers_started(found, name) == {0: [0], 1: [1]}, name
    assert ACROSS in first, "hybrid's mp groups cross the two nodes here: no warning given"


def test_every_strategy_under_srun_two_nodes_two_tasks_each(tmp_path):
    found, first = _srun(tmp_path, 2, 2, ALL)
    check(found, ALL, [0, 1, 2, 3], "SLURMEnvironment")
    for name in SERVERS:
        assert servers_started(found, name) == {0: [0], 1: [], 2: [1], 3: []}, name
    hybrid = {r["rank"]: r for r in found if r["strategy"] == "hybrid"}
    assert {r["world"] for r in hybrid.values()} == {4}
    assert ACROSS not in first, "hybrid (mp=2 within each node of 2) warned of crossing nodes"


def test_the_derived_port_is_lightnings(monkeypatch):
    """The fixture is what Lightning reads as a SLURM task: ranks from ``SLURM_*``, the
    port derived from the job id, the address the node list's first host."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    job = free_job_id()
    for key in list(os.environ):
        monkeypatch.delenv(key)
    for key, value in srun_env(job, 1, 2, 1).items():
        monkeypatch.setenv(key, value)
    assert SLURMEnvironment.detect()
    slurm = SLURMEnvironment()
    assert (slurm.global_rank(), slurm.node_rank(), slurm.world_size()) == (1, 1, 2)
    assert slurm.main_port == slurm_port(job) and slurm.main_address == "127.0.0.1"


def test_an_interactive_salloc_allocation_lets_lightning_start_the_ranks(tmp_path):
    names = [*SERVERS, "ring_allreduce", "hybrid"]
    command = python(["2", "1", *names], salloc_env(free_job_id(), 1, 2))
    found = results(run_all([command], tmp_path, limit_for(names)))
    check(found, names, [0], "LightningEnvironment")
    assert all(r["launch"] == "fork" for r in found), found  # Lightning started them


def test_every_strategy_under_torchrun_c10d_rendezvous_two_agents(tmp_path):
    port, run_id = find_free_port(), uuid.uuid4().hex[:8]
    commands = [torchrun_c10d(run_id, port, 2, 1, ALL) for _ in range(2)]
    found = results(run_all(commands, tmp_path, limit_for(ALL)))
    check(found, ALL, [0, 1], "TorchElasticEnvironment")
    for name in SERVERS:  # (c10d numbers the nodes itself: each started one server)
        assert sorted(map(len, servers_started(found, name).values())) == [1, 1], name


def test_every_strategy_under_two_torchrun_agents_of_two_processes(tmp_path):
    port = find_free_port()
    commands = [torchrun_static(node, port, 2, 2, ALL) for node in (0, 1)]
    outputs = run_all(commands, tmp_path, limit_for(ALL, 4))
    found = results(outputs)
    check(found, ALL, [0, 1, 2, 3], "TorchElasticEnvironment")
    for name in SERVERS:
        assert servers_started(found, name) == {0: [0], 1: [], 2: [1], 3: []}, name
    assert ACROSS not in outputs[0]


def test_server_strategies_under_srun_on_one_node(tmp_path):
    names = [*SERVERS, "ring_allreduce", "gpipe"]
    found, _ = _srun(tmp_path, 1, 2, names)
    check(found, names, [0, 1], "SLURMEnvironment")
    for name in SERVERS:  # one node: its local rank 0 starts both servers
        assert servers_started(found, name) == {0: [0, 1], 1: []}, name


def test_server_strategies_under_lightnings_forkserver_launch_from_a_script(tmp_path):
    """Each rank's servers come from a nested forkserver (the launch a GPU machine falls back
    to after a backward pass); the main process gets rank 0's weights."""
    names = [*SERVERS, "ring_allreduce"]
    env = clean_env({"LIGHTNING_PAR_START_METHOD": "forkserver"})
    found = results(run_all([python(["2", "1", *names], env)], tmp_path, limit_for(names)))
    check(found, names, [0], "LightningEnvironment")
    assert all(r["launch"] == "forkserver" for r in found), found


def test_a_task_whose_rank_0_never_starts_stops_with_a_named_error(tmp_path):
    """A stalled rendezvous is bounded (the group timeout) and says what it waited for."""
    job = free_job_id()
    cmd, env = python(["1", "2", "ring_allreduce"], srun_env(job, 1, 2, 1))  # rank 0 absent
    env["LIGHTNING_PAR_TIMEOUT"] = "5"
    (out,) = run_all([(cmd, env)], tmp_path, limit=150, ok=False)
    expected = f"RendezvousTimeout: rank 1: no job store at 127.0.0.1:{slurm_port(job)} after 5 s"
    assert expected in out, out[-3000:]


def test_launch_limits_grow_with_server_starts_and_load_but_stay_bounded(monkeypatch):
    """The forkserver launch of the server strategies took 237 s at load 17 (every RESULT
    printed) and was killed at 210 s: limits count each Trainer call's server start and the
    machine's load, up to ``MAX_LOAD_FACTOR`` times the unloaded limit."""
    import conformance.launchers as launchers

    monkeypatch.setattr(launchers.os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    ring = launchers.limit_for(["ring_allreduce"])
    servers = launchers.limit_for([*SERVERS, "ring_allreduce"])
    assert servers == launchers.limit_for(["a", "b", "ring_allreduce"]) + 2 * (
        launchers.SERVER_START_S
    )
    assert servers > 237 and ring < servers
    monkeypatch.setattr(launchers.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(launchers.os, "getloadavg", lambda: (40.0, 40.0, 40.0))
    assert launchers.limit_for(["ring_allreduce"]) == ring * launchers.MAX_LOAD_FACTOR
