"""A user's script run as users run it, for the tests that lose a rank in it.

The script runs in a session of its own (so that every process it starts can be found, and
killed at the limit), with a private temporary folder (so that what it leaves there can be
listed) and with no fault planned by the test process's own environment. Each output line
is kept with the time it arrived, for the tests that bound how soon a loss is reported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from lightning_par.launch.faults import FAULT_ENV
from lightning_par.launch.processes import kill_tree

TESTS = Path(__file__).parent
#: torch's own, kept by design: the compiler's cache
THEIRS = ("torchinductor",)


def session_members(sid: int) -> list[int]:
    """The live (not zombie) processes of session ``sid``."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(entry))
    return found


@dataclass
class ScriptRun:
    """What :func:`run_script` saw: the exit code, each output line with the time it arrived,
    the processes of the script's session still alive after it ended, and the names left in
    its temporary folder."""

    code: int
    lines: list[tuple[float, str]]
    session: list[int]
    left: list[str]

    @property
    def text(self) -> str:
        return "".join(line for _, line in self.lines)


def run_script(
    cmd: list[str], folder: Path, limit_s: float, env: dict[str, str] | None = None,
    stderr_only: bool = False, settle_s: float = 0.0,
) -> ScriptRun:  # fmt: skip
    """Run ``cmd`` in ``folder`` with ``folder/tmp`` as its ``TMPDIR`` and this checkout on
    its path, for at most ``limit_s`` (then its whole session is killed). ``env`` adds to
    the environment; ``stderr_only``: keep the lines of standard error alone (standard
    output is read and dropped); ``settle_s``: how long to wait for the session's last
    processes to end on their own (a parameter server's exit is asynchronous)."""
    private_tmp = folder / "tmp"
    private_tmp.mkdir()
    environ = {**os.environ, "TMPDIR": str(private_tmp), **(env or {})}
    environ["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), *sys.path])
    environ.pop(FAULT_ENV, None)
    proc = subprocess.Popen(
        cmd, cwd=folder, env=environ, stdout=subprocess.PIPE, text=True,
        stderr=subprocess.PIPE if stderr_only else subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    lines: list[tuple[float, str]] = []
    kept = proc.stderr if stderr_only else proc.stdout
    readers = [threading.Thread(target=lambda: lines.extend((time.monotonic(), x) for x in kept))]
    if stderr_only:
        readers.append(threading.Thread(target=proc.stdout.read))
    for reader in readers:
        reader.start()
    try:
        proc.wait(timeout=limit_s)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait()
        for reader in readers:
            reader.join()
    deadline = time.monotonic() + settle_s
    while (session := [p for p in session_members(proc.pid) if p != proc.pid]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.2)
    left = sorted(p.name for p in private_tmp.iterdir() if not p.name.startswith(THEIRS))
    return ScriptRun(proc.returncode, lines, session, left)
