"""A ``popen`` launch's lost rank, seen from its launching process: that process is rank 0
itself, and its other ranks are scripts it started.

Lightning watches those scripts with its ``_ChildProcessObserver``, which SIGKILLs the
launching process 5 s after a child fails, before it can say anything. :class:`ScriptRanks`
takes its place: it names the lost script in one line (or leaves a script killed by a signal
behind, under ``fault_tolerant``), and kills a script rank 0's heartbeat found silent so that
rank 0's collective fails at once. A fork launch's ranks are joined by
:func:`._lost_ranks.joined_by_us` instead; why one line and no traceback: :mod:`._lost_ranks`.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from lightning_par import _compat
from lightning_par.launch import liveness
from lightning_par.launch.heartbeat import report_and_exit
from lightning_par.launch.lost import LAUNCHER_RANK_ENV, RankLost, how_it_ended, read_reports
from lightning_par.launch.processes import stop_process_groups
from lightning_par.strategies._lost_ranks import GRACE_S

log = logging.getLogger("lightning_par")

#: Seconds the launching process of a ``popen`` launch waits at exit for its scripts.
EXIT_WAIT_S = 10.0


class ScriptRanks:
    """A ``popen`` launch seen from its launching process, which is rank 0: the ranks it
    started as scripts (ranks ``first + 1 ..``), and which of them was lost.

    While the scripts start (:meth:`watching`) it takes the place of Lightning's observer of
    them: the first that ends with an error is recorded, and rank 0's own failure (a
    collective that finds the connection closed) reports it (:meth:`cause_of`); if rank 0
    has not failed within :data:`~._lost_ranks.GRACE_S` (it computes alone, say), this ends the job,
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
