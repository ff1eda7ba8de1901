"""The processes behind ``run_on_ranks``: free loopback ports, ranks that compute after the
parent started its OpenMP pool, tensors that outlive the ranks, a bounded command that dies
with its parent, and a start whose gloo mesh failed to connect, tried again or reported
with the rank. (Messages and the ranks' failures: ``test_comm.py``.)"""

import os
import time

import pytest
import torch
from test_comm import _echo

from lightning_par.comm import RankFailed, find_free_port, run_on_ranks


def test_free_ports_differ_and_bind_loopback():
    import socket

    ports = [find_free_port() for _ in range(5)]
    assert len(set(ports)) == 5 and all(1024 < p < 65536 for p in ports)
    for port in ports:  # each is free on the loopback address the ranks rendezvous on
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


# Rank functions live at module level: where fork is unsafe (a GPU machine after a backward
# pass) run_on_ranks starts them through a forkserver, which pickles them.
def _compute(rank, world_size):
    a = torch.randn(600, 600)
    conv = torch.nn.functional.conv2d(torch.randn(32, 16, 32, 32), torch.randn(16, 16, 3, 3))
    return torch.get_num_threads(), bool(torch.isfinite((a @ a).sum() + conv.sum()))


def test_ranks_compute_after_the_parent_started_its_openmp_pool():
    # A forked child that enters its parent's OpenMP pool hangs forever (reproduced with
    # torch 2.14 and libgomp, whatever thread count the child picks above one);
    # run_on_ranks computes on one thread per rank.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _compute(0, 1)  # starts the pool in this process
        assert run_on_ranks(_compute, 2, timeout=10) == [(1, True), (1, True)]
    finally:
        torch.set_num_threads(threads)


def _tensors(rank, world_size):
    return {"weights": torch.full((1000,), float(rank)), "grads": [torch.ones(3) * rank]}


def test_tensors_returned_by_ranks_survive_the_ranks_exit():
    results = run_on_ranks(_tensors, 3)
    time.sleep(0.5)  # every rank has exited; the data must still be readable here
    for rank, out in enumerate(results):
        assert torch.equal(out["weights"], torch.full((1000,), float(rank)))
        assert out["grads"][0].tolist() == [float(rank)] * 3


def test_a_bounded_command_dies_with_the_process_that_ran_it(tmp_path):
    # e.g. `timeout 150 python -m lightning_par.check` killing the check: its row (which
    # runs in a session of its own) must not live on
    import signal
    import subprocess
    import sys

    pid_file = tmp_path / "child.pid"
    sleeper = (
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    )
    runner = tmp_path / "runner.py"
    runner.write_text(
        "import sys\nfrom lightning_par.launch.processes import run_bounded\n"
        f"run_bounded([sys.executable, '-c', {sleeper!r}], 300)\n"
    )
    parent = subprocess.Popen([sys.executable, str(runner)])
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline and parent.poll() is None
            time.sleep(0.1)
        child = int(pid_file.read_text())
        parent.send_signal(signal.SIGKILL)  # no finally runs in the parent
        parent.wait()
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{child}"), "the command outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()


def _fail_the_first_mesh_of_rank_1(marker):
    """``init_process_group`` as gloo fails it now and then on loopback: once, in rank 1."""
    from lightning_par.launch import run

    real = run.init_process_group

    def init(rank, world_size, **kw):
        if rank == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            raise RuntimeError(
                "Gloo connectFullMesh failed with [pair.cc:561] Connection closed by peer"
            )
        return real(rank, world_size, **kw)

    return init


def test_a_start_whose_gloo_mesh_failed_to_connect_is_tried_again(tmp_path, monkeypatch):
    from lightning_par.launch import run
    from lightning_par.launch.policy import LaunchPlan

    marker = str(tmp_path / "failed-once")
    monkeypatch.setattr(run, "init_process_group", _fail_the_first_mesh_of_rank_1(marker))
    monkeypatch.setattr(run, "plan_launch", lambda *a, **k: LaunchPlan("fork", 1, "test"))
    assert run_on_ranks(_echo, 2, 5) == [(0, 2, 5), (1, 2, 5)]
    assert os.path.exists(marker)  # the first start did fail


def test_a_start_is_tried_again_when_one_rank_ran_and_another_failed_to_connect(
    tmp_path, monkeypatch
):
    # seen in a loaded CI run: rank 0's start went through and its function (which sends
    # nothing) returned, then rank 1 reported gloo's "Connection closed by peer"
    from lightning_par.launch import run
    from lightning_par.launch.policy import LaunchPlan

    real, marker = run.init_process_group, str(tmp_path / "failed-once")

    def init(rank, world_size, **kw):
        if not os.path.exists(marker):
            if rank == 0:
                return None  # as if connected: its function runs and returns at once
            time.sleep(1.0)  # rank 0's result is in first
            open(marker, "w").close()
            raise RuntimeError("Gloo connectFullMesh failed with [pair.cc:561] Connection closed")
        return real(rank, world_size, **kw)

    monkeypatch.setattr(run, "init_process_group", init)
    monkeypatch.setattr(run, "plan_launch", lambda *a, **k: LaunchPlan("fork", 1, "test"))
    assert run_on_ranks(_echo, 2, 5) == [(0, 2, 5), (1, 2, 5)]
    assert os.path.exists(marker)


def test_a_mesh_that_keeps_failing_is_reported_with_the_rank(tmp_path, monkeypatch):
    from lightning_par.launch import run
    from lightning_par.launch.policy import LaunchPlan

    def never(rank, world_size, **kw):
        raise RuntimeError("Gloo connectFullMesh failed with [pair.cc:561] Connection refused")

    monkeypatch.setattr(run, "init_process_group", never)
    monkeypatch.setattr(run, "plan_launch", lambda *a, **k: LaunchPlan("fork", 1, "test"))
    with pytest.raises(RankFailed, match="rank 0 of 2 raised"):
        run_on_ranks(_echo, 2, 5)
