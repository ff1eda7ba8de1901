"""Rank 0 of a ``popen`` launch, kept apart from the process the user started, so that a
fault-tolerant run goes on without it.

Under ``popen`` the user's ``python script.py`` is rank 0: it holds the job's store and
starts the other ranks as scripts. Killed, it would take the store with it, and the shell
would see the script end by a signal while the survivors trained on. So at its first
``Trainer`` call of a strategy that survives rank 0's loss, that process becomes rank 0's
keeper instead (:func:`run_rank_0_behind_keeper`):

* it serves the job's store itself (:mod:`.store_host`) and tells every rank so
  (``KEPT_STORE_ENV``: rank 0's end is not the store's);
* it starts rank 0 as one more run of the script (the command Lightning starts the other
  ranks with), which finds the store and goes on as rank 0 of a ``popen`` launch does.
  Not a fork of this process: a forked child cannot use CUDA initialised here, and hangs
  in its first multi-threaded OpenMP region if this process computed on several threads
  (the reasons ``popen`` is chosen). Like the other ranks, rank 0 runs the script's lines
  before its first ``Trainer`` call once more;
* it only waits, passing Ctrl-C and SIGTERM on to the ranks (:class:`_PassedOn`: they
  run in a process group of their own); the ranks of a rank 0 that died become its
  children (a Linux "subreaper"). It ends:

  - as rank 0 did when rank 0 exited (after the other ranks end, for up to
    :data:`EXIT_WAIT_S`);
  - when rank 0 was killed: with one line naming it, after every rank ended (the store
    is theirs until then), with 0, or with the first error code of a survivor; but when
    the signal that ended rank 0 came through the keeper, the others get it too.

The keeper never returns to the script (``os._exit``): the script's lines after its first
``Trainer`` call, and its ``atexit`` handlers, run in the ranks.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from typing import NoReturn

from lightning_par.launch.lost import REPORTS_ENV, how_it_ended, new_folder_name
from lightning_par.launch.processes import (
    become_subreaper,
    descendants,
    die_with_parent,
    stop_process_groups,
)
from lightning_par.launch.rendezvous import KEPT_STORE_ENV, STORE_ENV, host_job_store
from lightning_par.launch.store_host import job_store_host

#: Seconds the keeper waits for the other ranks once rank 0 exited (it waited for them).
EXIT_WAIT_S = 15.0


def runs_behind_keeper() -> bool:
    """Whether this process is a rank of a launch whose rank 0 has a keeper (rank 0, or a
    script it started)."""
    return bool(os.environ.get(KEPT_STORE_ENV))


def can_keep() -> bool:
    """Whether rank 0 can run behind a keeper here (Linux: the keeper adopts the ranks of
    a rank 0 that died, to wait for them)."""
    return sys.platform.startswith("linux")


def run_rank_0_behind_keeper(name: str, command: list[str], cwd: str | None) -> NoReturn:
    """Become rank 0's keeper (see the module docstring): start rank 0 by ``command`` (in
    ``cwd``), wait, and end. ``name``: how the line names rank 0."""
    os.environ[STORE_ENV] = host_job_store()
    os.environ[KEPT_STORE_ENV] = "1"
    folder = os.environ.setdefault(REPORTS_ENV, new_folder_name())
    host = job_store_host()
    store_host = host.process.pid
    become_subreaper()
    sys.stdout.flush()
    sys.stderr.flush()
    passing = _PassedOn()
    rank_0 = subprocess.Popen(command, cwd=cwd, preexec_fn=_own_group_dying_with_parent)
    passing.rank_0 = rank_0.pid
    if passing.received is not None:  # (came as rank 0 started)
        passing.pass_on(passing.received, None)
    _, status = os.waitpid(rank_0.pid, 0)  # (retried after a signal's handler by Python)
    passing.rank_0_ended = True
    if os.WIFSIGNALED(status) and passing.received is None:  # lost: the others go on
        ended = how_it_ended(-os.WTERMSIG(status))
        print(f"lightning_par: {name} {ended}; the other ranks go on without it",
              file=sys.stderr, flush=True)  # fmt: skip
        code = _wait_for_ranks(store_host, None)
    elif os.WIFSIGNALED(status):  # ended by the signal passed on to it: so do the others
        passing.pass_on(passing.received, None)
        _wait_for_ranks(store_host, EXIT_WAIT_S)
        code = 128 + os.WTERMSIG(status)
    else:
        code = os.WEXITSTATUS(status)
        _wait_for_ranks(store_host, EXIT_WAIT_S)
    shutil.rmtree(folder, ignore_errors=True)
    host.close()  # (its parent-death signal would end it too, but only after this exit)
    os._exit(code)


def _own_group_dying_with_parent() -> None:
    # its own process group: a Ctrl-C reaching this process's group reaches the ranks once,
    # passed on by the keeper
    os.setpgid(0, 0)
    die_with_parent()


class _PassedOn:
    """Ctrl-C and SIGTERM reaching the keeper, passed on to the ranks (in rank 0's process
    group): Ctrl-C to every rank, as a terminal sends it to its foreground group; SIGTERM to
    rank 0, which stops the others as it does without a keeper, or once it ended to the
    survivors."""

    def __init__(self) -> None:
        self.rank_0: int | None = None  # (its process, once started)
        self.rank_0_ended = False
        self.received: int | None = None  # the last signal passed on
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self.pass_on)

    def pass_on(self, signum: int, frame: object) -> None:
        self.received = signum
        if self.rank_0 is None:
            return
        to_rank_0 = signum == signal.SIGTERM and not self.rank_0_ended
        try:
            (os.kill if to_rank_0 else os.killpg)(self.rank_0, signum)
        except OSError:
            pass  # every rank ended meanwhile


def _wait_for_ranks(store_host: int, limit_s: float | None) -> int:
    """Wait until no process but the store's host is left below this one (for up to
    ``limit_s``, then stop them); the first error code a rank exited with, else 0."""
    deadline = None if limit_s is None else time.monotonic() + limit_s
    code = 0
    while True:
        while True:  # reap the ranks adopted from rank 0
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if code == 0 and os.WIFEXITED(status) and os.WEXITSTATUS(status) > 0:
                code = os.WEXITSTATUS(status)
        left = [pid for pid in descendants(os.getpid()) if pid != store_host]
        if not left:
            return code
        if deadline is not None and time.monotonic() >= deadline:
            stop_process_groups([_Pid(pid) for pid in left])
            deadline = None
        time.sleep(0.2)


class _Pid:
    """A process by its id (what :func:`stop_process_groups` reads of one)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
