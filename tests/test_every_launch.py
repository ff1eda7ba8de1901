"""Every registered strategy under every launch a user has, from a script in a fresh
interpreter: fork, forkserver, popen (the GPU default), torchrun on one node, two torchrun
agents as two nodes on 127.0.0.1. (SLURM job steps, ``salloc``, torchrun's c10d rendezvous
and nodes of several processes: ``tests/conformance/test_conf_launchers.py``, with the
launch fixtures and helpers shared here, :mod:`conformance.launchers`.)

One script invocation per launch trains its strategies in turn (``every_launch_script.py``:
``fit``, then ``validate`` and ``test`` with the same Trainer), so the interpreters start once
per launch. Each synchronous strategy must give one process's weights; ``async_sgd`` must
train and end cleanly. Every command runs in its own session and the whole group is killed
at the time limit, naming the command that hung; ports are chosen free by the OS.
"""

from __future__ import annotations

import pytest
from conformance.launchers import (
    ALL,
    SERVERS,
    check,
    clean_env,
    fork_script_env,
    limit_for,
    python,
    results,
    run_all,
    servers_started,
    torchrun_static,
)

from lightning_par.launch.rendezvous import find_free_port


@pytest.mark.parametrize(
    "method, names",
    [("popen", ALL), ("fork", ALL), ("forkserver", [*SERVERS, "ring_allreduce"])],
)
def test_every_strategy_from_a_script(tmp_path, method, names):
    env = clean_env({"LIGHTNING_PAR_START_METHOD": method})
    env = fork_script_env(env) if method == "fork" else env
    out = run_all([python(["2", "1", *names], env)], tmp_path, limit=limit_for(names))
    found = results(out)
    ranks = [0, 1] if method == "popen" else [0]  # (a fork launch: the main process reports)
    check(found, names, ranks, "LightningEnvironment")
    assert all(r["launch"] in (method, None) for r in found), found


def test_every_strategy_under_two_torchrun_agents_as_two_nodes(tmp_path):
    port = find_free_port()
    commands = [torchrun_static(node, port, 2, 1, ALL) for node in (0, 1)]
    found = results(run_all(commands, tmp_path, limit=limit_for(ALL)))
    check(found, ALL, [0, 1], "TorchElasticEnvironment")
    for name in SERVERS:  # ps-lite's server role: each node starts its share
        assert servers_started(found, name) == {0: [0], 1: [1]}, name


def test_server_strategies_under_torchrun_on_one_node(tmp_path):
    names = [*SERVERS, "lightning_ddp"]
    command = torchrun_static(0, find_free_port(), 1, 2, names)
    found = results(run_all([command], tmp_path, limit_for(names)))
    check(found, names, [0, 1], "TorchElasticEnvironment")
