"""Joining the ranks of a launch: a lost rank named in one line, a lost ``async_sgd`` worker
survived, nothing of torch's left in the temporary folder.

Lightning's fork launcher joins its ranks with torch's ``ProcessContext.join``: at the first
rank that fails it waits 30 s for the rest (a frozen rank ignores the SIGTERM that follows),
then raises "process 1 terminated with signal SIGKILL" under the traceback of its own join
loop, and each rank that raised leaves a ``pytorch-errorfile-*.pickle`` behind. A fork
launch joins its ranks with :func:`_join` instead:

* at the first rank that fails, every rank is looked at (for up to :data:`GRACE_S` while the
  others end on their own): a rank that ended without raising (killed, ``os._exit``) or that
  a peer reported silent (:mod:`lightning_par.launch.lost`) is the cause, whatever its peers
  raised after it ("Connection closed by peer"). Every rank is stopped and
  :class:`~lightning_par.launch.lost.RankLost` names the lost one;
* otherwise (a Python error raised in a rank) torch's join stops the rest and reports it
  (:mod:`._rank_errors` raises it again with its own type);
* with ``survive_lost_workers`` (``async_sgd``, ``fault_tolerant=True``), a worker other
  than 0 that ended without raising is reported and left behind, and the others go on
  (rank 0 too where the strategy survives it: a survivor then sends the results);
* torch's error files are removed once read.

A ``popen`` launch's process is rank 0 itself and its other ranks are scripts it started:
:class:`ScriptRanks` takes the place of Lightning's observer of those (which SIGKILLs the
launching process 5 s after a child fails, before it can say anything).

Why one line and no traceback: a rank killed by the OS leaves no Python traceback; torch's
is of its own join loop and the survivors' are the echo of the loss, which hid the cause.
Lightning reports a lost child in one log line too (its ``_ChildProcessObserver``). The
details (how every rank ended, what the others raised) stay on the exception
(``RankLost.details``) and in the ``lightning_par`` logger at ``DEBUG``.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.connection
import os
import pickle
import shutil
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning_par import _compat
from lightning_par.launch import liveness
from lightning_par.launch.heartbeat import report_and_exit
from lightning_par.launch.lost import LAUNCHER_RANK_ENV, RankLost, how_it_ended, read_reports
from lightning_par.launch.processes import stop_process_groups

log = logging.getLogger("lightning_par")

#: Seconds the others get to end on their own once one rank failed (torch's default: 30 s
#: after SIGTERM, which a frozen rank ignores); also how long the launching process of a
#: ``popen`` launch gets to report a lost child itself.
GRACE_S = 3.0
#: Seconds the launching process of a ``popen`` launch waits at exit for its scripts.
EXIT_WAIT_S = 10.0


def _abrupt(context: Any, index: int) -> bool:
    """Whether rank ``index`` ended without raising (no error file: killed, ``os._exit``)."""
    code = context.processes[index].exitcode
    return code not in (None, 0) and not os.path.exists(context.error_files[index])


def _lost(context: Any, folder: str | None, name: Callable[[int], str]) -> RankLost | None:
    """The lost rank, if one is: reported silent by a peer, else ended without raising (a
    signal's death before an exit code's; not a worker the job went on without)."""
    reports = read_reports(folder)
    if reports:
        rank, text = reports[0]
        return RankLost(text, rank)
    ended = [
        i for i in range(len(context.processes))
        if _abrupt(context, i) and i not in context.left_behind
    ]  # fmt: skip
    if not ended:
        return None
    rank = min(ended, key=lambda i: (context.processes[i].exitcode > 0, i))
    return RankLost(f"{name(rank)} {how_it_ended(context.processes[rank].exitcode)}", rank)


def _await_cause(context: Any, grace_s: float, folder: str | None, name: Callable) -> Any:
    """Give the ranks up to ``grace_s`` to end on their own, as soon as the lost rank is
    known; the lost rank (``RankLost``) or None."""
    deadline = time.monotonic() + grace_s
    while True:
        lost = _lost(context, folder, name)
        running = [p for p in context.processes if p.is_alive()]
        if lost is not None or not running or time.monotonic() >= deadline:
            return lost
        multiprocessing.connection.wait([p.sentinel for p in running], timeout=0.05)


def _details(context: Any) -> str:
    """How each rank ended, and what those that raised said (torch's error files)."""
    lines = []
    for index, process in enumerate(context.processes):
        lines.append(f"rank {index}: exit code {process.exitcode}")
        try:
            with open(context.error_files[index], "rb") as f:
                lines.append(str(pickle.load(f)).rstrip())
        except Exception:
            continue  # none written (it did not raise), or unreadable
    return "\n".join(lines)


def _join(
    context: Any, timeout: float | None, grace_s: float, folder: str | None,
    name: Callable[[int], str], survive_lost_workers: bool, survive_rank_zero: bool = False,
) -> bool:  # fmt: skip
    """One round of torch's ``ProcessContext.join`` (see the module docstring)."""
    if not context.sentinels:
        return True
    for sentinel in multiprocessing.connection.wait(list(context.sentinels), timeout=timeout):
        index = context.sentinels.pop(sentinel)
        process = context.processes[index]
        process.join()
        if process.exitcode == 0:
            continue
        survivable = survive_lost_workers and (index != 0 or survive_rank_zero)
        if survivable and _abrupt(context, index):
            if not read_reports(folder):  # (a reporter of a silent peer: the job ends)
                print(
                    f"lightning_par: {name(index)} {how_it_ended(process.exitcode)}; the other "
                    "workers go on without it", file=sys.stderr, flush=True,
                )  # fmt: skip
                context.left_behind.add(index)
                continue
        start = time.monotonic()
        lost = _await_cause(context, grace_s, folder, name)
        if lost is None:  # a rank raised: torch's join reports it (this one, the first seen)
            context.sentinels = {sentinel: index}
            left = max(0.0, grace_s - (time.monotonic() - start))
            return type(context).join(context, timeout, left)
        stop_process_groups([p for p in context.processes if p.is_alive()])
        for each in context.processes:
            each.join()
        details = _details(context)
        log.debug("lightning_par: %s\n%s", lost, details)
        lost.details = details
        if survive_lost_workers and lost.rank == 0:
            lost.args = (f"{lost} (worker 0 holds the logging, the checkpoints and the "
                         "parameter servers: the job cannot go on without it)",)  # fmt: skip
        raise lost
    return not context.sentinels


def _remove_error_files(context: Any) -> None:
    for path in context.error_files:
        try:
            os.remove(path)
        except OSError:
            pass  # never written: the rank did not raise


@contextmanager
def joined_by_us(
    folder: str | None, name: Callable[[int], str], survive_lost_workers: bool,
    survive_rank_zero: bool = False,
) -> Iterator[None]:  # fmt: skip
    """While a fork launch starts its ranks, join them with :func:`_join`: lost ranks named
    (their peers' reports in ``folder``, ranks named by ``name``), lost workers left behind
    if ``survive_lost_workers`` (rank 0 too if ``survive_rank_zero``: a survivor takes over
    its share and sends the results), torch's error files removed."""

    def ours(context: Any) -> Any:
        def join(timeout: float | None = None, grace_period: float | None = None) -> bool:
            grace = GRACE_S if grace_period is None else grace_period
            try:
                done = _join(context, timeout, grace, folder, name, survive_lost_workers,
                             survive_rank_zero)  # fmt: skip
            except BaseException:
                _remove_error_files(context)
                raise
            if done:
                _remove_error_files(context)
            return done

        context.join = join
        context.left_behind = set()  # lost workers the job went on without
        return context

    with _compat.patched_start_processes(ours):
        yield


class ScriptRanks:
    """A ``popen`` launch seen from its launching process, which is rank 0: the ranks it
    started as scripts (ranks ``first + 1 ..``), and which of them was lost.

    While the scripts start (:meth:`watching`) it takes the place of Lightning's observer of
    them: the first that ends with an error is recorded, and rank 0's own failure (a
    collective that finds the connection closed) reports it (:meth:`cause_of`); if rank 0
    has not failed within :data:`GRACE_S` (it computes alone, say), this ends the job,
    printing ``describe(lost)``. A script that rank 0's heartbeat finds silent
    (:meth:`silent`) is killed, so rank 0's collective fails at once, and is reported as
    silent. The scripts leave their reports in ``folder``."""

    def __init__(
        self, name: Callable[[int], str], first: int, folder: str,
        describe: Callable[[RankLost], str], survive: bool = False,
    ) -> None:  # fmt: skip
        self.name, self.first, self.folder, self.describe = name, first, folder, describe
        self.survive = survive  # a script killed by a signal is left behind (fault_tolerant)
        self.left_behind: set[int] = set()
        self.procs: list = []
        self.handled = threading.Event()
        self._silent: RankLost | None = None

    @contextmanager
    def watching(self) -> Iterator[None]:
        """While Lightning starts the scripts and rank 0 joins their group: watch both."""
        os.environ.setdefault(LAUNCHER_RANK_ENV, str(self.first))  # (the scripts inherit it)
        with _compat.replaced_process_observer(self.observe):
            with liveness.silent_peers_handed_to(self.silent):
                yield

    def observe(self, procs: list) -> None:
        """Lightning started the scripts: watch them, and at exit wait for them a moment
        (registered after the job's store host, so it runs before that host is stopped:
        a script still finishing would otherwise find its store gone, and torch prints a
        C++ stack for each of its calls)."""
        self.procs = procs
        threading.Thread(target=self._watch, daemon=True, name="lightning_par-scripts").start()
        atexit.register(self._wait_for_scripts)

    def _wait_for_scripts(self, limit_s: float = EXIT_WAIT_S) -> None:
        deadline = time.monotonic() + limit_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:
                return  # still running: it dies with this process (die_with_parent)

    def _failed(self) -> RankLost | None:
        codes = [(self.first + 1 + i, p.poll()) for i, p in enumerate(self.procs)]
        failed = [
            (rank, code) for rank, code in codes
            if code not in (None, 0) and rank not in self.left_behind
        ]  # fmt: skip
        if not failed:
            return None
        rank, code = min(failed, key=lambda f: (f[1] > 0, f[0]))  # a signal's death first
        return RankLost(f"{self.name(rank)} {how_it_ended(code)}", rank)

    def _watch(self) -> None:
        while not self.handled.wait(0.2):
            failed = self._failed()
            code = None if failed is None else self.procs[failed.rank - self.first - 1].poll()
            if failed is not None and self.survive and code is not None and code < 0:
                if self.handled.is_set():  # rank 0 stopped it: the job ends, nothing is lost
                    return
                print(f"lightning_par: {failed}; the other workers go on without it",
                      file=sys.stderr, flush=True)  # fmt: skip
                self.left_behind.add(failed.rank)
                continue
            if failed is not None:
                if not self.handled.wait(GRACE_S):
                    self._end_job(self.cause())
                return
            if all(p.poll() == 0 for p in self.procs):
                return

    def silent(self, rank: int, report: str) -> None:
        """Rank 0's heartbeat found ``rank`` silent: kill its script (see the class)."""
        self._silent = RankLost(report, rank)
        index = rank - self.first - 1
        if 0 <= index < len(self.procs):
            stop_process_groups([self.procs[index]])
        else:  # not a script of this process's (another node's): this rank ends the job
            report_and_exit(self.name(self.first), rank, report)

    def _end_job(self, lost: RankLost | None) -> None:
        """Rank 0 did not fail on its own after a script was lost: say so, stop every
        script and end (as Lightning's observer would, which says nothing)."""
        if lost is not None:
            print(f"lightning_par: {self.describe(lost)}", file=sys.stderr, flush=True)
        stop_process_groups(self.procs)
        shutil.rmtree(self.folder, ignore_errors=True)
        os._exit(1)

    def cause_of(self, error: BaseException) -> RankLost | None:
        """The lost rank that made rank 0 fail with ``error``, if one did (with ``error``
        in its details)."""
        if isinstance(error, KeyboardInterrupt):  # (Ctrl-C or SIGTERM: rank 0 stops every
            self.handled.set()  # script itself, and one it kills is not a lost one)
            return None
        lost = self.cause()
        if lost is not None:
            lost.details = "".join(traceback.format_exception(error))
            log.debug("lightning_par: %s; rank 0 failed with:\n%s", lost, lost.details)
        return lost

    def cause(self, grace_s: float = 1.0) -> RankLost | None:
        """The lost rank, if one is (rank 0 reports it: the watch stands down). Waits up to
        ``grace_s`` for one: rank 0's collective can fail on the closed connection of a
        killed script a moment before that script can be seen to have ended."""
        self.handled.set()
        deadline = time.monotonic() + grace_s
        while self._silent is None:
            reports = read_reports(self.folder)
            if reports:
                return RankLost(reports[0][1], reports[0][0])
            failed = self._failed()
            if failed is not None or time.monotonic() >= deadline:
                return failed
            time.sleep(0.05)
        return self._silent
