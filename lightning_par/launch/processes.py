"""Processes that must not outlive their limit or their parent.

Plumbing shared by :func:`~lightning_par.launch.run.run_on_ranks`, the strategies' launcher,
the parameter-server processes, the benchmarks and the tests: kill a process with every
process it started, make a child die with its parent, start children from a forkserver that
leaves nothing behind, run a command or a block of code under a wall-clock limit.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux ``/proc``; empty elsewhere)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process it started (data workers, ranks of ranks)."""
    for victim in [*descendants(pid), pid]:
        try:
            os.kill(victim, signal.SIGKILL)
        except OSError:
            pass  # gone already


def stop_process_groups(procs) -> None:
    """Kill each process (a ``multiprocessing.Process`` or ``Popen``) and all it started."""
    for proc in procs:
        if proc.pid is not None:
            kill_tree(proc.pid)


def exit_on_sigterm() -> None:
    """A command's main process: SIGTERM (``kill``, ``timeout``, the end of a SLURM job) ends
    it as Ctrl-C does, by an exception in the main thread, so that its ``finally`` blocks and
    ``with`` blocks run: its temporary folders go, and the commands it runs through
    :func:`run_bounded` are stopped the same way first."""

    def end(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, end)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (a rank must not outlive the
    process that started it, e.g. one killed by a timeout); no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def become_subreaper() -> bool:
    """Ask Linux to make this process the parent of every orphan among its descendants (so
    that it can wait for the ranks of a child that died); whether it did (False elsewhere)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    PR_SET_CHILD_SUBREAPER = 36
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1) == 0
    except OSError:
        return False


_forkserver_owner: int | None = None  # the process that registered _end_forkserver


def forkserver_context(preload: list[str]) -> Any:
    """multiprocessing's ``forkserver`` context, importing ``preload`` once, that leaves
    nothing behind:

    * its children share this process's multiprocessing folder (``pymp-*`` in the temporary
      folder, where a forkserver's socket lives), which this process removes as it exits.
      Otherwise the first child, created before the server started, makes one of its own,
      which stays when that child is killed (a parameter servers' worker stopped after
      another rank was lost);
    * the server process ends with this one (SIGKILL at exit: it only forks; the children
      it forked are done or die with it). multiprocessing lets it end by itself once it
      reads that this process is gone, which with torch imported takes a second or two
      after the script returned.
    """
    import multiprocessing as mp
    import multiprocessing.util

    global _forkserver_owner
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preload)
    mp.util.get_temp_dir()
    if _forkserver_owner != os.getpid():  # (once per process; a forked child registers anew)
        _forkserver_owner = os.getpid()
        # after the finalizers that stop children (priority >= 0), before the folder's (-100)
        mp.util.Finalize(None, _end_forkserver, args=(os.getpid(),), exitpriority=-50)
    return ctx


def _end_forkserver(owner: int) -> None:
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid is None or os.getpid() != owner:
        return
    try:
        if os.waitpid(pid, os.WNOHANG) == (0, 0):  # (raises unless it is this process's child)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    except OSError:
        pass  # ended and reaped already


class Completed:
    """What :func:`run_bounded` saw: exit code, output, whether it ran out of time."""

    def __init__(self, returncode: int, stdout: str, stderr: str, timed_out: bool) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr
        self.timed_out = timed_out


def run_bounded(cmd: list[str], timeout: float, **popen_kwargs: Any) -> Completed:
    """Run ``cmd`` in its own session; after ``timeout`` seconds kill its whole process
    group (the command and every rank it started), so nothing outlives the limit. The
    command also dies with this process, however this one ends (e.g. killed by a
    ``timeout`` around it, when no ``finally`` runs)."""
    import subprocess

    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=die_with_parent, **popen_kwargs,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
        return Completed(proc.returncode, out, err, False)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        _kill_group(proc.pid)
        out, err = proc.communicate()
        return Completed(proc.returncode, out, err, True)
    finally:
        if proc.poll() is None:  # interrupted: leave nothing behind
            _stop_group(proc)


#: Seconds an interrupted command has to end on SIGTERM (removing its temporary folders).
STOP_GRACE_S = 10.0


def _stop_group(proc: Any) -> None:
    """SIGTERM ``proc``'s process group, then SIGKILL what is left after
    :data:`STOP_GRACE_S` (what a command left for not ending in time is lost)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=STOP_GRACE_S)
    except Exception:  # (no group any more, or still running)
        pass
    kill_tree(proc.pid)
    _kill_group(proc.pid)
    proc.wait()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


class TimeLimitExceeded(RuntimeError):
    """A block ran past the wall-clock limit :func:`time_limit` gave it."""


@contextmanager
def time_limit(seconds: float, message: str) -> Iterator[None]:
    """Raise :class:`TimeLimitExceeded` (``message``) in the main thread after ``seconds``.

    Whatever started ranks inside the block stops them on the way out (the strategies'
    launcher and :func:`run_on_ranks` kill their ranks on any exception). Limits nest: inside
    an outer limit that ends sooner, the outer one stands (with its message); otherwise the
    outer one is armed again on the way out with the time it had left."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return
    outer_left = signal.getitimer(signal.ITIMER_REAL)[0]
    if 0 < outer_left <= seconds:
        yield
        return

    def expired(signum, frame):
        raise TimeLimitExceeded(message)

    entered = time.monotonic()
    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_left > 0:  # the outer limit goes on (at once if its time ran out meanwhile)
            left = outer_left - (time.monotonic() - entered)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3))
