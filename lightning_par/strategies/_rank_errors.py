"""A rank's own exception, raised again in the main process of a fork/forkserver launch.

torch's process context reports a failed rank as ``ProcessRaisedException``, which carries
only the rank's traceback as text: a notebook's ``except ValueError`` (or
``pytest.raises``) around ``trainer.fit`` would not see the user's ``ValueError``. Each
rank that fails pickles its exception into a folder of the launch, and writes the last
frames of its traceback beside it as plain text; the main process raises that exception
again, chained to torch's report, with a note holding those frames: the rank's failing line
reaches the script however it shows the error (``traceback.print_exc()``, an uncaught
error, or just ``format_exception_only``, which prints notes but no cause). An exception
that cannot be pickled or unpickled leaves torch's report as it was.
"""

from __future__ import annotations

import os
import pickle
import shutil
import time
import traceback

from lightning_par.launch.lost import make_private_folder

#: How many of the rank's innermost frames the note shows (the user's step is among them).
FRAMES = 8
#: The most characters of a rank's traceback text the main process reads.
MAX_TEXT = 20_000


def rank_traceback(error: BaseException, frames: int = FRAMES) -> str:
    """The innermost ``frames`` frames of ``error``'s traceback and its message, as text."""
    lines = traceback.format_exception(
        type(error), error, error.__traceback__, limit=-frames, chain=False
    )
    return "".join(lines).rstrip("\n")


class RankErrors:
    """The folder one launch's ranks write their exceptions to: named by the main process,
    made by the first rank that fails (:func:`~lightning_par.launch.lost.new_folder_name`),
    removed by the main process."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def _path(self, rank: int) -> str:
        return os.path.join(self.folder, f"rank{rank}.pickle")

    def _text_path(self, rank: int) -> str:
        return os.path.join(self.folder, f"rank{rank}.traceback.txt")

    def save(self, rank: int, error: BaseException) -> None:
        """In the failing rank: keep ``error`` for the main process, if it pickles, and as
        text when it failed and its traceback's last frames (the pickle carries no
        traceback)."""
        failed_at = time.monotonic_ns()  # one clock for every process of this machine
        try:
            data = pickle.dumps(error)
            pickle.loads(data)  # what the main process would fail to rebuild, it never gets
        except Exception:
            return
        try:
            text = rank_traceback(error)
        except Exception:  # a broken __str__: the exception still travels, without its frames
            text = ""
        if not make_private_folder(self.folder):
            return
        with open(self._text_path(rank), "w", encoding="utf-8", errors="replace") as f:
            f.write(f"{failed_at}\n{text}")
        with open(self._path(rank), "wb") as f:
            f.write(data)

    def _record(self, rank: int) -> tuple[int, str] | None:
        """When the rank failed and its traceback text (plain text, never unpickled)."""
        try:
            with open(self._text_path(rank), encoding="utf-8", errors="replace") as f:
                first, _, text = f.read(MAX_TEXT).partition("\n")
            return int(first), text
        except (OSError, ValueError):
            return None

    def _first_failed(self, reported: int) -> int:
        """The rank that failed first: the others most often failed because it left (a
        peer's receive finds the connection closed). torch reports whichever rank its join
        finds first, which can be such a peer. ``reported`` unless another saved earlier
        (or when its own error was not saved: its report is torch's text)."""
        mine = self._record(reported)
        if mine is None:
            return reported
        first, when = reported, mine[0]
        for name in os.listdir(self.folder):  # (it exists: the reported rank wrote there)
            rank = _rank_of(name)
            record = self._record(rank) if rank is not None else None
            if record is not None and record[0] < when:
                first, when = rank, record[0]
        return first

    def original(self, report: BaseException) -> BaseException | None:
        """The exception of the rank torch's ``report`` names, with a note saying which rank
        raised it and where; ``None`` when there is none to give (not a rank's error, not
        pickled)."""
        reported = getattr(report, "error_index", None)
        if type(report).__name__ != "ProcessRaisedException" or reported is None:
            return None
        rank = self._first_failed(reported)
        try:
            with open(self._path(rank), "rb") as f:
                error = pickle.load(f)
        except Exception:  # none saved, or its class does not load here
            return None
        record = self._record(rank)
        note = _note(rank, reported, record[1] if record else "")
        if hasattr(error, "add_note"):  # Python >= 3.11
            error.add_note(note)
        else:  # older Pythons print no notes: the message carries it
            _append_to_message(error, note)
        return error

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _note(rank: int, reported: int, text: str) -> str:
    """Which rank raised the error, and its last frames (text)."""
    if rank != reported:  # torch's report, the cause, is of a rank that failed after it
        where = f"raised on rank {rank}, the first to fail (rank {reported} failed after it)"
    else:
        where = f"raised on rank {rank}"
    if not text:
        return f"({where}; torch's report of its traceback is above)"
    kept = [line for line in text.splitlines() if not _carets(line)]
    indented = "\n".join("  | " + line for line in kept)
    return f"({where}; the last {FRAMES} frames of its traceback:)\n{indented}"


def _rank_of(name: str) -> int | None:
    """``N`` of a saved ``rankN.pickle`` (``None`` for any other file)."""
    stem = name.removeprefix("rank").removesuffix(".pickle")
    is_pickle = name.startswith("rank") and name.endswith(".pickle")
    return int(stem) if is_pickle and stem.isdigit() else None


def _carets(line: str) -> bool:
    """A line of Python 3.11's ``^^^^`` marks under a frame's code (noise in a short note)."""
    marks = line.strip()
    return bool(marks) and set(marks) <= set("^~")


def _append_to_message(error: BaseException, note: str) -> None:
    """Python < 3.11: put ``note`` after a one-argument message (others stay as they are:
    their arguments may mean something to the code that catches them)."""
    if len(error.args) == 1 and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]}\n{note}",)
