"""A rank's own exception, raised again in the main process of a fork/forkserver launch.

torch's process context reports a failed rank as ``ProcessRaisedException``, which carries
only the rank's traceback as text: a notebook's ``except ValueError`` (or
``pytest.raises``) around ``trainer.fit`` would not see the user's ``ValueError``. Each
rank that fails pickles its exception into a folder of the launch; the main process raises
that exception again, chained to torch's report, whose text holds the rank's traceback.
An exception that cannot be pickled or unpickled leaves torch's report as it was.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile

#: Prefix of the temporary folder where the ranks of one launch leave their exceptions.
ERRORS_PREFIX = "lightning_par-errors-"


class RankErrors:
    """The folder one launch's ranks write their exceptions to (made in the main process)."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix=ERRORS_PREFIX)

    def _path(self, rank: int) -> str:
        return os.path.join(self.folder, f"rank{rank}.pickle")

    def save(self, rank: int, error: BaseException) -> None:
        """In the failing rank: keep ``error`` for the main process, if it pickles."""
        try:
            data = pickle.dumps(error)
            pickle.loads(data)  # what the main process would fail to rebuild, it never gets
        except Exception:
            return
        with open(self._path(rank), "wb") as f:
            f.write(data)

    def original(self, report: BaseException) -> BaseException | None:
        """The exception of the rank torch's ``report`` names, with a note saying which rank
        raised it; ``None`` when there is none to give (not a rank's error, not pickled)."""
        rank = getattr(report, "error_index", None)
        if type(report).__name__ != "ProcessRaisedException" or rank is None:
            return None
        try:
            with open(self._path(rank), "rb") as f:
                error = pickle.load(f)
        except Exception:  # none saved, or its class does not load here
            return None
        if hasattr(error, "add_note"):  # Python >= 3.11
            error.add_note(f"(raised on rank {rank}; its traceback is above)")
        return error

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
