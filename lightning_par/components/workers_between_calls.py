"""The workers' process group between two trainer calls of a script that goes on in every
worker (``popen``, torchrun, SLURM), for the strategies with server processes.

A clean call ends its servers and the group of workers and servers. Lightning's barrier
in ``save_checkpoint`` and the collectives of the next call's set-up still need a group,
as under Lightning's DDP, whose group lives on after ``fit``: the workers meet again
alone, once all are back (:func:`wait_for_workers`), and keep that group as the default
one until the next call of a server-group strategy, which ends it before it starts its
own (:func:`end_kept_group`).
"""

from __future__ import annotations

import atexit
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_par.components.process_group import destroy_process_group
from lightning_par.components.worker_context import WorkerContext
from lightning_par.launch import peer_loss
from lightning_par.launch.lost import RankLost
from lightning_par.launch.rendezvous import wait_until_connected


class _KeptGroup:
    """The workers-only group the last call left for the script's next call, if any."""

    group: Any = None


_kept = _KeptGroup()


def wait_for_workers(
    store: Any, rank: int, workers: list[int], timeout: timedelta, beat: Any,
    name: Callable[[int], str],
) -> None:  # fmt: skip
    """Wait in ``store`` until the ``workers`` (ranks; those a fault-tolerant call went on
    without are not among them) are all back from a call, before they form a group of
    their own. A worker lost during the call (``async_sgd`` goes on without it)
    never comes: gloo's rendezvous would wait for it for the whole ``timeout``, deaf to
    signals (torchrun's agent stopping the job). Here a silent one that a server handed
    over in ``beat``'s group (:func:`~lightning_par.launch.peer_loss.handed_over`)
    ends the wait at once with :class:`RankLost` naming it, and ``timeout`` with one naming
    those that did not come."""
    store.set(f"lightning_par/back/{rank}", "1")
    keys = {w: f"lightning_par/back/{w}" for w in workers}
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check(list(keys.values())):
        handed = peer_loss.handed_over(beat) if beat is not None else None
        if handed is not None:
            raise RankLost(handed[1], handed[0])
        if time.monotonic() > deadline:
            missing = [w for w, key in keys.items() if not store.check([key])]
            raise RankLost(
                f"{', '.join(map(name, missing))} did not come back from the call within the "
                f"timeout ({timeout.total_seconds():g} s): lost during it", missing[0],
            )  # fmt: skip
        time.sleep(0.05)


def keep_workers_group(ctx: WorkerContext, beat: Any, alive: list[int]) -> None:
    """The default group from now: the workers alone, once all are back (one lost during
    the call never comes), but the ``alive`` ones only (the call went on without the
    others: ``fault_tolerant``), renumbered in their order."""
    store, _ = ctx.group_store()
    wait_for_workers(store, ctx.rank, alive, ctx.timeout, beat, ctx.rank_name)
    dist.init_process_group(
        "gloo", store=store, rank=alive.index(ctx.rank), world_size=len(alive),
        timeout=ctx.timeout,
    )  # fmt: skip
    wait_until_connected("gloo")  # (the next call may end this group at once)
    _kept.group = dist.group.WORLD
    atexit.register(destroy_process_group)  # (a gloo group alive at exit can abort it)


def end_kept_group() -> None:
    """End the workers' group the last call kept (of this strategy or another's), if any."""
    if _kept.group is None:
        return
    if dist.is_initialized() and dist.group.WORLD is _kept.group:
        dist.destroy_process_group()
    _kept.group = None
