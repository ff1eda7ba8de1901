"""``run_on_ranks``: run a function on n local ranks and get each rank's result back.

Used by the tests, the benchmarks and the notebooks. Ranks start as the launch policy says
(:func:`~lightning_par.launch.policy.plan_launch`: ``fork`` when it is safe, else a clean
``forkserver``); each rank leads its own process group, so that a rank that raises, dies
or hangs is stopped together with every process it started, and no rank outlives the
process that started it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from lightning_par.launch.parent_state import ParentState
from lightning_par.launch.policy import FORKSERVER_PRELOAD, limit_threads_after_fork, plan_launch
from lightning_par.launch.processes import die_with_parent, forkserver_context, stop_process_groups
from lightning_par.launch.rendezvous import (
    RUN_TIMEOUT_S,
    default_timeout,
    find_free_port,
    init_process_group,
)


def forkserver_threads(world_size: int) -> int:
    """Intra-op threads of a forkserver rank (a fresh process would take every core): the
    caller's ``OMP_NUM_THREADS`` where set, else the rank's share of the cores, as Lightning
    gives its ranks."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    return max(1, (os.cpu_count() or 1) // world_size)


class RankFailed(RuntimeError):
    """A rank raised, died or timed out inside :func:`run_on_ranks`: ``raised`` are the ranks
    that raised, ``dead`` those that exited without a result, ``hung`` those still running
    at the deadline."""

    def __init__(self, report: str, dead: tuple[int, ...] = (), hung: tuple[int, ...] = (),
                 raised: tuple[int, ...] = ()):  # fmt: skip
        super().__init__(report)
        self.dead, self.hung, self.raised = dead, hung, raised


class _MeshFailed(RankFailed):
    """gloo could not connect the ranks' mesh: ``fn`` did not run on every rank, so the start
    can be tried again with a fresh store (a rare loopback race, also seen in torch's own CI:
    pytorch/pytorch#53270)."""


#: How often a start whose gloo mesh failed to connect is tried again.
MESH_RETRIES = 2


def _rank_main(fn, rank, world_size, backend, store, port, timeout_s, threads, args, kwargs,
               queue, parent):  # fmt: skip
    import torch.distributed as dist

    die_with_parent()
    parent.restore()  # a forkserver rank: the caller's environment, random state and output
    if threads:
        limit_threads_after_fork(threads)
    # (MASTER_* describe the job to a Lightning Trainer inside fn, which finds the group
    # already made; the ranks meet in a file, which no other job can take)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    try:
        init_process_group(
            rank, world_size, backend=backend, rendezvous_file=store,
            timeout=timedelta(seconds=timeout_s),
        )  # fmt: skip
    except RuntimeError as err:
        mesh = "connectFullMesh" in str(err)
        queue.put((rank, "mesh" if mesh else "error", traceback.format_exc()))
        return
    try:
        args, kwargs = own_copies((args, kwargs))
        result = fn(rank, world_size, *args, **kwargs)
        # plain pickle copies tensors' data: the queue's own pickler would share their
        # memory with the parent, which fails once this rank has exited
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def own_copies(data: Any) -> Any:
    """``data`` with every tensor (and module's parameters and buffers) that lives in shared
    memory copied: torch pickles tensors for a forkserver or spawn child into shared pages,
    the same in every rank, so one rank's in-place update would change all ranks' data.
    Lists, tuples, dicts and dataclasses (frozen ones too) are searched; other objects are
    passed as they are."""
    import dataclasses

    import torch

    @torch.no_grad()
    def own(obj: Any) -> Any:
        if isinstance(obj, torch.nn.Module):
            for t in [*obj.parameters(), *obj.buffers()]:
                if t.is_shared():
                    t.data = t.data.clone()
            return obj
        if isinstance(obj, torch.Tensor):
            if obj.is_shared():
                return obj.detach().clone().requires_grad_(obj.requires_grad)
            return obj
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            return type(obj)(own(x) for x in obj)
        if isinstance(obj, tuple):  # a named tuple
            return type(obj)(*(own(x) for x in obj))
        if isinstance(obj, dict):
            owned = {k: own(v) for k, v in obj.items()}
            return owned if type(obj) is dict else _same_kind(obj, owned)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            changes = {}
            for f in dataclasses.fields(obj):
                if f.init:
                    value = getattr(obj, f.name)
                    owned = own(value)
                    if owned is not value:
                        changes[f.name] = owned
            return dataclasses.replace(obj, **changes) if changes else obj
        return obj

    return own(data)


def _same_kind(original: dict, items: dict) -> dict:
    """``items`` in ``original``'s dict type where it can be rebuilt so, else as is."""
    try:
        return type(original)(items)
    except TypeError:  # e.g. a defaultdict: keep its contents, updated in place
        original.update(items)
        return original


def _collect(queue, results: dict[int, Any]) -> list[tuple[int, str, str]]:
    """Move finished ranks' results into ``results``; return the failures seen as
    ``(rank, kind, traceback)``, ``kind`` being ``"mesh"`` or ``"error"``."""
    failures = []
    while not queue.empty():
        rank, kind, value = queue.get()
        if kind == "ok":
            results[rank] = pickle.loads(value)
        else:
            failures.append((rank, kind, value))
    return failures


def _dead_ranks(procs, results, failures) -> tuple[int, ...]:
    """Ranks that exited with an error code before returning or reporting anything."""
    failed = {r for r, _, _ in failures}
    return tuple(
        r for r, p in enumerate(procs)
        if r not in results and r not in failed and p.exitcode not in (None, 0)
    )  # fmt: skip


def _failure_report(procs, dead, failures, world_size) -> str:
    lines = [
        f"rank {r} of {world_size} died with exit code {procs[r].exitcode} before returning a "
        "result"
        for r in dead
    ]
    return "\n".join(lines + [f"rank {r} of {world_size} raised:\n{tb}" for r, _, tb in failures])


def _wait_for_results(procs: list, queue: Any, results: dict[int, Any], deadline_s: float) -> None:
    """Collect every rank's result into ``results``; :class:`RankFailed` as soon as a rank
    raised or died (naming it), or when ``deadline_s`` passed (naming those not done)."""
    world_size = len(procs)
    deadline = time.monotonic() + deadline_s
    while len(results) < world_size:
        failures = _collect(queue, results)
        exited = any(p.exitcode not in (None, 0) for p in procs)
        if failures or exited:
            time.sleep(0.3)  # let the root cause (often a dead peer) surface too
            failures += _collect(queue, results)
            dead = _dead_ranks(procs, results, failures)
            report = _failure_report(procs, dead, failures, world_size)
            # only a mesh that failed to connect, no rank dead: start again (a rank whose mesh
            # failed never ran ``fn``, so what the others returned is dropped; the race seen
            # under load, rank 0 ending the group while rank 1 still connected, is closed by
            # init_process_group's wait_until_connected)
            retry = not exited and all(k == "mesh" for _, k, _ in failures)
            raised = tuple(r for r, kind, _ in failures if kind == "error")
            raise (_MeshFailed if retry else RankFailed)(report, dead=dead, raised=raised)
        if time.monotonic() > deadline:
            missing = tuple(sorted(set(range(world_size)) - set(results)))
            raise RankFailed(
                f"rank(s) {list(missing)} of {world_size} did not finish within {deadline_s:.0f} s"
                " (hung or deadlocked); all ranks were stopped",
                hung=missing,
            )
        time.sleep(0.005)


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` local ranks.

    Each rank joins a fresh process group (meeting in a temporary file) and its return value
    is sent back; the list is ordered by rank. ``timeout`` (default:
    ``LIGHTNING_PAR_TIMEOUT`` or 60 s: short runs) applies to every collective and receive;
    10 s later the parent stops ranks stuck elsewhere. If a rank raises, exits or hangs,
    every rank and what it started is killed and :class:`RankFailed` names the rank (a dead
    rank first, since its peers' errors are only the echo of its death). Forked ranks
    compute on the threads the launch policy allows (one if the parent ran OpenMP); when
    forking is unsafe, ``fn`` and the arguments must be picklable (module-level).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    group_timeout = default_timeout(RUN_TIMEOUT_S).total_seconds() if timeout is None else timeout
    for attempt in range(MESH_RETRIES + 1):
        try:
            return _run_once(fn, world_size, backend, group_timeout, args, kwargs)
        except _MeshFailed:
            if attempt == MESH_RETRIES:
                raise
    raise AssertionError("unreachable")


def _run_once(fn, world_size, backend, group_timeout, args, kwargs) -> list[Any]:
    """One start of :func:`run_on_ranks`: ranks in a fresh store, stopped whatever happens."""
    plan = plan_launch("cpu", world_size, can_exec=False)
    deadline_s = group_timeout + 10
    ctx = mp.get_context(plan.method)
    threads = plan.threads_per_rank
    if plan.method == "forkserver":
        ctx = forkserver_context(FORKSERVER_PRELOAD)
        threads = forkserver_threads(world_size)
    queue = ctx.SimpleQueue()
    store_dir = tempfile.mkdtemp(prefix="lightning_par-ranks-")
    store, port = os.path.join(store_dir, "rendezvous"), find_free_port()
    procs = [
        ctx.Process(target=_rank_main, daemon=True, args=(
            fn, r, world_size, backend, store, port, group_timeout, threads, args, kwargs,
            queue, ParentState(),
        ))
        for r in range(world_size)
    ]  # fmt: skip
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    try:
        _wait_for_results(procs, queue, results, deadline_s)
    finally:
        for proc in procs:
            proc.join(timeout=5 if len(results) == world_size else 0)
        stop_process_groups([p for p in procs if p.is_alive()])
        for proc in procs:
            proc.join()
        queue.close()
        shutil.rmtree(store_dir, ignore_errors=True)
    return [results[r] for r in range(world_size)]
