"""A rank whose loss the job survives, seen by torchrun or SLURM as a rank that ended well.

torchrun's agent watches the processes it started: the first one to end with an error code
or a signal makes it stop every other worker (SIGTERM to each one's process group, SIGKILL
30 s later) and fail the job, or restart every worker with ``--max-restarts``. The
survivors of a fault-tolerant run would be stopped while they went on. ``srun`` may end a
job step for a task killed by a signal as well, depending on the cluster's settings.

So under a launcher that is not ours, a rank of a strategy that survives lost ranks forks
once, as its first ``Trainer`` call begins (:func:`keep`, before any process group or
thread of ours exists). The child is the rank: it goes on with the script from where it
stands, in a copy-on-write copy of the memory. The parent is the process the launcher
watches. It only waits for the child, then ends as follows:

* the child exited: the parent exits with the same code;
* the child was ended by a signal (killed, or frozen and then ended by a peer's
  heartbeat) and the job goes on without it: the parent prints one line naming the rank
  and exits with 0, so the launcher leaves the survivors alone;
* the child was ended by a signal and the job cannot go on without it (rank 0): the parent
  ends by the same signal, so the launcher sees what it would have seen without a keeper.

Under SLURM rank 0 serves the job's store. Where the job goes on without rank 0, rank 0's
keeper serves it instead (started before the fork), and stays until every rank has ended:
each keeper counts its rank's end in the store (:func:`count_end`).

torchrun and ``scancel`` signal the whole process group (torch's ``SubprocessHandler``
starts each worker in a session of its own and ends it with ``killpg``). The child is in
that group, so it receives and handles those signals itself, and the parent ignores
SIGINT and SIGTERM. The parent never returns to the script and leaves with ``os._exit``:
the script's ``atexit`` handlers run once, in the child.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import NoReturn

from lightning_par.launch.lost import how_it_ended

#: Whether this process forked its keeper already (the first ``Trainer`` call did).
_kept = False
#: The key of the job's store each keeper adds 1 to when its rank ended (:func:`count_end`).
ENDED_KEY = "lightning_par/keepers/ended"


def keep(name: str, tolerated: bool, after: Callable[[], None] | None = None) -> None:
    """Fork this rank once (later calls return at once); return in the child, which is
    the rank from now on, and end the parent when the child ends (see the module
    docstring). ``name``: how the rank is named (``"rank 1"``); ``tolerated``: whether
    the job goes on without it; ``after``: run in the parent once the child ended, before
    it ends (:func:`count_end`)."""
    global _kept
    if _kept:
        return
    _kept = True
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        return
    _wait_and_end(child, name, tolerated, after)


def kept() -> bool:
    """Whether this process forked behind its keeper already (at its first call)."""
    return _kept


def count_end(host: str, port: int, world: int | None = None) -> None:
    """In a keeper whose rank ended: count it in the job's store at ``host:port``; with
    ``world``, wait until every rank of the ``world`` has ended (the keeper that serves the
    store: the survivors use it until their end). A store already gone counts nothing."""
    import torch.distributed as dist

    try:
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=30))  # fmt: skip
        ended = store.add(ENDED_KEY, 1)
        while world is not None and ended < world:
            time.sleep(0.2)
            ended = store.add(ENDED_KEY, 0)
    except (RuntimeError, OSError):
        return  # (torch's DistNetworkError is a RuntimeError)


def _wait_and_end(
    child: int, name: str, tolerated: bool, after: Callable[[], None] | None
) -> NoReturn:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)  # the child, in this group, gets them too
    _, status = os.waitpid(child, 0)  # (retried on EINTR by Python)
    signum = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    if signum is not None and tolerated:
        print(
            f"lightning_par: {name} {how_it_ended(-signum)}; the other ranks go on without it",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    try:
        if after is not None:
            after()
    finally:
        if signum is None:
            os._exit(os.WEXITSTATUS(status))
        if tolerated:
            os._exit(0)
        if signum not in (signal.SIGKILL, signal.SIGSTOP):  # (these two keep their action)
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)  # (a signal that does not end a process by default)
