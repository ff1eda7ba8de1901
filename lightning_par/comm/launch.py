"""Launching ranks: the start-method policy and a fork-based runner for tests and notebooks.

Policy (:func:`choose_start_method`): under torchrun, SLURM or another cluster launcher
the processes already exist; in notebooks and tests ``fork`` (1 s instead of 8-15 s for a
fresh interpreter on the 2-core CI machine, and it works with functions defined in a
notebook cell). In scripts, Lightning's standard ``popen`` launcher, except on a CPU whose
cores give each rank at most one thread anyway, where ``fork`` starts faster and loses
nothing. Why threads decide it: a forked rank must compute on one thread, because it hangs
in its first multi-threaded OpenMP region if the parent had already used OpenMP (GNU
libgomp is not fork-safe); and a forked child cannot use CUDA that the parent touched.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from lightning_par.comm.rendezvous import default_timeout, find_free_port, init_process_group

START_METHODS = ("fork", "popen", "spawn", "forkserver")


def is_interactive() -> bool:
    """True inside Jupyter/IPython or the plain interactive interpreter."""
    main = sys.modules.get("__main__")
    return (
        hasattr(sys, "ps1") or bool(getattr(main, "__IPYTHON__", 0)) or ("ipykernel" in sys.modules)
    )


def under_cluster_launcher() -> bool:
    """True when torchrun, SLURM or an MPI launcher already started one process per rank."""
    env = os.environ
    return ("LOCAL_RANK" in env and "WORLD_SIZE" in env) or "SLURM_NTASKS" in env


def choose_start_method(accelerator: str = "cpu", num_processes: int | None = None) -> str:
    """The start method for the extra ranks (``LIGHTNING_PAR_START_METHOD`` overrides).

    ``fork`` in notebooks and tests, and for CPU scripts whose ``num_processes`` ranks get
    at most one core each; ``popen`` otherwise (see the module docstring).
    """
    override = os.environ.get("LIGHTNING_PAR_START_METHOD")
    if override:
        if override not in START_METHODS:
            raise ValueError(
                f"LIGHTNING_PAR_START_METHOD={override!r} is not one of {START_METHODS}"
            )
        return override
    if is_interactive() or "pytest" in sys.modules:
        return "fork"
    cores_per_rank = (os.cpu_count() or 1) // max(1, num_processes or 1)
    if accelerator == "cpu" and cores_per_rank <= 1:
        return "fork"
    return "popen"


def one_thread_after_fork() -> None:
    """Call first thing in a forked rank: compute on one intra-op thread from now on.

    A forked child hangs in its first multi-threaded OpenMP region if its parent had
    already used OpenMP threads (GNU libgomp is not fork-safe; reproduced with torch 2.14
    for every thread count above one), and nothing tells the child whether it had. One
    thread per rank is always safe, and on a machine with no more cores than ranks it is
    what each rank would get anyway (the start-method policy forks scripts only then).
    """
    import torch

    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # so Lightning's launcher keeps it


class RankFailed(RuntimeError):
    """A rank raised, died or timed out inside :func:`run_on_ranks`."""


def _rank_main(fn, rank, world_size, backend, port, timeout_s, args, kwargs, queue) -> None:
    import torch.distributed as dist

    one_thread_after_fork()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    try:
        init_process_group(
            rank,
            world_size,
            backend=backend,
            master_port=port,
            timeout=timedelta(seconds=timeout_s),
        )
        result = fn(rank, world_size, *args, **kwargs)
        queue.put((rank, True, result))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(queue, results: dict[int, Any]) -> list[tuple[int, str]]:
    """Move finished ranks' results into ``results``; return the failures seen."""
    failures = []
    while not queue.empty():
        rank, ok, value = queue.get()
        if ok:
            results[rank] = value
        else:
            failures.append((rank, value))
    return failures


def _failure_report(procs, results, failures, world_size) -> str:
    failed = {r for r, _ in failures}
    dead = [
        f"rank {r} of {world_size} died with exit code {p.exitcode} before returning a result"
        for r, p in enumerate(procs)
        if r not in results and r not in failed and p.exitcode not in (None, 0)
    ]
    return "\n".join(dead + [f"rank {r} of {world_size} raised:\n{tb}" for r, tb in failures])


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` forked ranks.

    Each rank joins a fresh process group on a free loopback port and its return value
    is sent back; the list is ordered by rank. ``timeout`` (default:
    :func:`~lightning_par.comm.default_timeout`) applies to every collective and receive;
    10 s later the parent stops ranks stuck elsewhere. If a rank raises, exits or hangs,
    the others are killed and :class:`RankFailed` names the rank (a dead rank first, since
    its peers' errors are only the echo of its death). Each rank computes on one
    intra-op thread: see :func:`one_thread_after_fork`.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    group_timeout = default_timeout().total_seconds() if timeout is None else timeout
    deadline_s = group_timeout + 10
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    port = find_free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, r, world_size, backend, port, group_timeout, args, kwargs, queue),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + deadline_s
    try:
        while len(results) < world_size:
            failures = _collect(queue, results)
            exited = any(p.exitcode not in (None, 0) for p in procs)
            if failures or exited:
                time.sleep(0.3)  # let the root cause (often a dead peer) surface too
                failures += _collect(queue, results)
                raise RankFailed(_failure_report(procs, results, failures, world_size))
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(results))
                raise RankFailed(
                    f"rank(s) {missing} of {world_size} did not finish within {deadline_s:.0f} s"
                    " (hung or deadlocked); all ranks were stopped"
                )
            time.sleep(0.005)
    finally:
        for proc in procs:
            proc.join(timeout=5 if len(results) == world_size else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        queue.close()
    return [results[r] for r in range(world_size)]
