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
:class:`~._script_ranks.ScriptRanks` takes the place of Lightning's observer of those (which
SIGKILLs the launching process 5 s after a child fails, before it can say anything).

Why one line and no traceback: a rank killed by the OS leaves no Python traceback; torch's
is of its own join loop and the survivors' are the echo of the loss, which hid the cause.
Lightning reports a lost child in one log line too (its ``_ChildProcessObserver``). The
details (how every rank ended, what the others raised) stay on the exception
(``RankLost.details``) and in the ``lightning_par`` logger at ``DEBUG``.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import pickle
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning_par import _compat
from lightning_par.launch.lost import RankLost, how_it_ended, read_reports
from lightning_par.launch.processes import stop_process_groups

log = logging.getLogger("lightning_par")

#: Seconds the others get to end on their own once one rank failed (torch's default: 30 s
#: after SIGTERM, which a frozen rank ignores); also how long the launching process of a
#: ``popen`` launch gets to report a lost child itself.
GRACE_S = 3.0


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
