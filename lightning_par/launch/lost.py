"""A lost rank, named in one line: how a process of the job ended, and the reports its peers
leave for the process that launched the job.

A rank is *lost* when it ends without raising an error (killed by a signal: the OOM
killer's or a preemption's ``SIGKILL``; ``os._exit``) or stops responding (frozen, its
machine or network gone: :mod:`.liveness`). Its peers then fail with whatever their
transport says ("Connection closed by peer", a timeout) and torch's launcher with "process 1
terminated with signal SIGKILL" under the traceback of its own join loop: neither names the
cause. The launcher of this project says instead which rank was lost and how, in one line
(:class:`RankLost`).

A peer that finds a rank silent cannot hand that to the launcher directly (it may be a
forked rank, a re-run script or a parameter server), so it leaves its report in the launch's
folder, which the launcher names in :data:`REPORTS_ENV` before any rank starts. The folder
is made by the first process that writes into it, so a launch in which nothing failed, or
whose launcher was itself killed before anything failed, leaves none behind.
"""

from __future__ import annotations

import os
import signal
import stat
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

#: The folder where the processes of one launch leave what the launcher reports.
REPORTS_ENV = "LIGHTNING_PAR_REPORTS"
#: The rank the launching process is itself (``popen``: rank 0 of its node), which cannot
#: read a report about its own silence: a peer that finds it silent says so itself.
LAUNCHER_RANK_ENV = "LIGHTNING_PAR_LAUNCHER_RANK"
#: Prefix of that folder's name (in the temporary folder).
FOLDER_PREFIX = "lightning_par-errors-"
_REPORT = "lost-rank{}.txt"


def how_it_ended(exitcode: int) -> str:
    """``was killed by SIGKILL`` or ``exited with code N`` (a process's exit code)."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"


class RankLost(RuntimeError):
    """A rank of the job was lost (killed, ended without raising, or stopped responding);
    the message names it in one line. Raised in the process that launched the ranks.

    Attributes:
        rank: the lost rank.
        details: how every rank ended and what the others reported (also logged at
            ``DEBUG`` by the ``lightning_par`` logger), kept off the one line.
        said: whether the line was printed already (by a rank that found the loss, before
            its launcher could end it): uncaught, it is not printed again.
    """

    def __init__(self, message: str, rank: int, details: str = "") -> None:
        super().__init__(message)
        self.rank, self.details, self.said = rank, details, False


_previous_hook = None  # the excepthook before one_line_when_uncaught's


def _one_line(kind: type[BaseException], error: BaseException, trace: object) -> None:
    if isinstance(error, RankLost):
        if not error.said:
            print(f"lightning_par: {error}", file=sys.stderr, flush=True)
        return
    (_previous_hook or sys.__excepthook__)(kind, error, trace)


def one_line_when_uncaught() -> None:
    """From now on, a :class:`RankLost` that ends the script prints as its one line, not
    under a traceback (its frames are the launcher's and Lightning's, and its cause is in
    another process), and not at all if it was printed already."""
    global _previous_hook
    if _previous_hook is None:
        _previous_hook, sys.excepthook = sys.excepthook, _one_line


@contextmanager
def reports_to(folder: str) -> Iterator[None]:
    """While inside, the processes this one starts leave their reports in ``folder``."""
    previous = os.environ.get(REPORTS_ENV)
    os.environ[REPORTS_ENV] = folder
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(REPORTS_ENV, None)
        else:
            os.environ[REPORTS_ENV] = previous


def new_folder_name() -> str:
    """A fresh name for one launch's folder (not made yet: see the module docstring)."""
    return os.path.join(tempfile.gettempdir(), f"{FOLDER_PREFIX}{uuid.uuid4().hex[:12]}")


def make_private_folder(folder: str) -> bool:
    """Make ``folder`` (mode 700) unless it exists; whether it is a folder of this user's
    (not a link another user placed there)."""
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return False
    info = os.lstat(folder)
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()


def launcher_names(lost_rank: int) -> bool:
    """Whether the process that launched this one is of this project and names
    ``lost_rank`` itself: not under torchrun or SLURM, nor when it is that rank (``popen``)."""
    launcher_rank = os.environ.get(LAUNCHER_RANK_ENV)
    return bool(os.environ.get(REPORTS_ENV)) and launcher_rank != str(lost_rank)


def leave_report(lost_rank: int, text: str) -> bool:
    """In a process of a launch of this project: leave ``text`` (which names
    ``lost_rank`` and how it was lost) for the launcher; False when no launcher of this
    project waits for one (:func:`launcher_names`), or it cannot be written."""
    folder = os.environ.get(REPORTS_ENV)
    if not launcher_names(lost_rank) or not folder or not make_private_folder(folder):
        return False
    path = os.path.join(folder, _REPORT.format(lost_rank))
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(partial, path)  # whole or absent, for a launcher reading at any moment
    except OSError:
        return False
    return True


def read_reports(folder: str | None) -> list[tuple[int, str]]:
    """The reports left in ``folder``, oldest first, as ``(lost rank, text)``."""
    if folder is None:
        return []
    found = []
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    for name in names:
        stem = name.removeprefix("lost-rank").removesuffix(".txt")
        if not (name.startswith("lost-rank") and name.endswith(".txt") and stem.isdigit()):
            continue
        path = os.path.join(folder, name)
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                found.append((os.path.getmtime(path), int(stem), f.read(2000).strip()))
        except OSError:
            continue
    return [(rank, text) for _, rank, text in sorted(found)]
