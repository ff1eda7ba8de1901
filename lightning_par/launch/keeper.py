"""A rank whose loss the job survives, seen by torchrun or SLURM as a rank that ended well.

torchrun's agent watches the processes it started: the first one to end with an error code
or a signal makes it stop every other worker (SIGTERM to each one's process group, SIGKILL
30 s later) and fail the job, or restart every worker with ``--max-restarts``. The
survivors of a fault-tolerant run would be stopped while they went on. ``srun`` may end a
job step for a task killed by a signal as well, depending on the cluster's settings.

So under a launcher that is not ours, the process the launcher started becomes the rank's
keeper at its first ``Trainer`` call (:func:`keep`): it starts the rank as one more run of
the script, with the same command and environment (and :data:`KEPT_ENV`, so that the run
knows it is the rank and goes on), then only waits for it, and ends as follows:

* the rank exited: the keeper exits with the same code;
* the rank was ended by a signal (killed, or frozen and then ended by a peer's heartbeat)
  and the job goes on without it: the keeper prints one line naming the rank and exits
  with 0, so the launcher leaves the survivors alone. If restarts are allowed
  (torchrun's ``--max-restarts``, or :data:`RESTARTS_ENV` under SLURM), it first starts a
  replacement, the script again with :data:`~.joining.JOIN_ENV`, which joins the
  survivors at a step boundary with the training state of a healthy peer
  (:mod:`.joining`), and waits for that one instead. torchrun would restart every worker of
  the node from the script's start; this restarts the lost one only;
* the rank was ended by a signal and the job cannot go on without it (rank 0): the keeper
  ends by the same signal, so the launcher sees what it would have seen without a keeper.

Not a fork of this process: a forked child hangs in its first multi-threaded OpenMP region
when its parent computed on several threads before (GNU OpenMP keeps a pool of threads the
child does not have; under ``srun`` a rank computes on every core of its allocation unless
``OMP_NUM_THREADS`` says otherwise), and it cannot use CUDA initialised in its parent. As
under Lightning's ``popen`` launch, the script's lines before its first ``Trainer`` call run
once more, in the rank.

Under SLURM rank 0 serves the job's store. Where the job goes on without rank 0, rank 0's
keeper serves it instead (started before the rank), and stays until every rank has ended:
each keeper counts its rank's end in the store (:func:`count_end`).

torchrun and ``scancel`` signal the whole process group (torch's ``SubprocessHandler``
starts each worker in a session of its own and ends it with ``killpg``). The rank is in
that group, so it receives and handles those signals itself, and the keeper ignores SIGINT
and SIGTERM. The keeper never returns to the script and leaves with ``os._exit``: the
script's ``atexit`` handlers run once, in the rank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import NoReturn

from lightning_par.launch.joining import JOIN_ENV
from lightning_par.launch.lost import how_it_ended
from lightning_par.launch.processes import die_with_parent

#: Set in the rank a keeper started: it is the rank, and keeps nothing itself.
KEPT_ENV = "LIGHTNING_PAR_KEPT_RANK"
#: How many times a lost rank is replaced where torchrun's ``--max-restarts`` does not say
#: (under SLURM).
RESTARTS_ENV = "LIGHTNING_PAR_MAX_RESTARTS"
#: Signals that stop a rank on purpose (the launcher's or a user's): never replaced.
_STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Whether this process is behind its keeper already (the first ``Trainer`` call did it).
_kept = False
#: The key of the job's store each keeper adds 1 to when its rank ended (:func:`count_end`).
ENDED_KEY = "lightning_par/keepers/ended"


def keep(name: str, tolerated: bool, command: list[str], cwd: str | None = None,
         after: Callable[[], None] | None = None, replaceable: bool = False) -> None:  # fmt: skip
    """Become this rank's keeper once: start the rank by ``command`` (in ``cwd``; the
    script again) and end when it ends (see the module docstring). Returns at once in the
    rank a keeper started, and at later calls. ``name``: how the rank is named
    (``"rank 1"``); ``tolerated``: whether the job goes on without it; ``after``: run in
    the keeper once the rank ended, before it ends (:func:`count_end`); ``replaceable``:
    whether a replacement can join the job in its place (:func:`restarts_allowed`)."""
    global _kept
    if kept():
        _kept = True
        return
    _kept = True
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)  # the rank, in this group, gets them too
    restarts = restarts_allowed() if tolerated and replaceable else 0
    env = {**os.environ, KEPT_ENV: "1"}
    while True:
        sys.stdout.flush()
        sys.stderr.flush()
        rank = subprocess.Popen(command, cwd=cwd, env=env, preexec_fn=_in_the_rank)
        _, status = os.waitpid(rank.pid, 0)  # (retried on EINTR by Python)
        stopped = os.WIFSIGNALED(status) and os.WTERMSIG(status) in _STOPS
        if not os.WIFSIGNALED(status) or stopped or restarts == 0:
            _end(status, name, tolerated, after)
        restarts -= 1
        print(
            f"lightning_par: {name} {how_it_ended(-os.WTERMSIG(status))}; the other ranks go "
            f"on without it, and its replacement starts to join them ({restarts} more "
            "restart(s) allowed)", file=sys.stderr, flush=True,
        )  # fmt: skip
        env = {**env, JOIN_ENV: "1"}


def _in_the_rank() -> None:
    """In the rank, before the script starts: it ends with its keeper, and handles the
    signals its keeper ignores (an ignored signal stays ignored across ``exec``)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)
    die_with_parent()


def restarts_allowed() -> int:
    """How many times a lost rank is replaced: torchrun's ``--max-restarts`` (its agent
    says it to its workers), else :data:`RESTARTS_ENV`; 0 by default."""
    if os.environ.get("TORCHELASTIC_MAX_RESTARTS", "").isdigit():
        return int(os.environ["TORCHELASTIC_MAX_RESTARTS"])
    text = os.environ.get(RESTARTS_ENV, "0").strip() or "0"
    if not text.isdigit():
        raise ValueError(
            f"{RESTARTS_ENV}={text!r}: give how many times a lost rank may be replaced, a "
            "whole number (0: never), e.g. 1"
        )
    return int(text)


def kept() -> bool:
    """Whether this process is behind its keeper (the rank a keeper started, or a process
    whose first call made it one)."""
    return _kept or bool(os.environ.get(KEPT_ENV))


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


def _end(status: int, name: str, tolerated: bool, after: Callable[[], None] | None) -> NoReturn:
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
