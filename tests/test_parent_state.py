"""A forkserver's children start from the caller's state, as forked ones do
(:mod:`lightning_par.launch.parent_state`): the launches fall back to a forkserver where fork
is unsafe (a GPU machine after a backward pass)."""

from __future__ import annotations

import os
import random

import torch

from lightning_par.launch import run_on_ranks

MARK = "LIGHTNING_PAR_TEST_MARK"


def _report(rank: int, world_size: int) -> tuple:
    print(f"rank {rank} says hello", flush=True)
    return os.environ.get(MARK), torch.rand(1).item(), random.random(), torch.get_num_threads()


def test_forkserver_ranks_start_from_the_callers_environment_random_state_and_output(
    monkeypatch, capfd
):
    import multiprocessing
    from multiprocessing import forkserver

    from lightning_par.launch.policy import FORKSERVER_PRELOAD

    forkserver._forkserver._stop()
    multiprocessing.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
    forkserver.ensure_running()  # started before the variable below is set: never sees it
    monkeypatch.setenv("LIGHTNING_PAR_START_METHOD", "forkserver")
    monkeypatch.setenv(MARK, "set after the server started")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # (a Lightning launch sets it)
    torch.manual_seed(5)
    random.seed(5)
    expected = (torch.rand(1).item(), random.random())
    torch.manual_seed(5)
    random.seed(5)
    results = run_on_ranks(_report, 2)
    threads = max(1, (os.cpu_count() or 1) // 2)  # a fresh process would take every core
    assert results == [("set after the server started", *expected, threads)] * 2
    out = capfd.readouterr().out
    assert "rank 0 says hello" in out and "rank 1 says hello" in out, out


def test_forkserver_ranks_keep_the_callers_thread_count_or_take_their_share(monkeypatch):
    from lightning_par.launch.run import forkserver_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = os.cpu_count() or 1
    assert forkserver_threads(2) == max(1, cores // 2)
    assert forkserver_threads(4 * cores) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert forkserver_threads(2) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")
    assert forkserver_threads(2) == max(1, cores // 2)
