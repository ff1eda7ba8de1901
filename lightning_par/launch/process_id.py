"""Which process a rank is, so that a peer on the same machine can tell that it ended.

gloo says only "Connection reset by peer" when a rank's process ends, and a launcher that
did not start the rank (torchrun's agent, a ``popen`` launch's scripts, which are not the
children of one another) cannot read its exit code. Each rank's heartbeat
(:mod:`.liveness`) therefore publishes its process's identity in the group's store: the
machine (Linux's boot id, which the containers of one machine share) with the pid namespace
(which they do not), the pid, and the process's start time (a pid is reused once its process
ended). A peer whose identity names this machine and pid namespace is looked up in
``/proc``: absent, a zombie, or another process under its pid means it ended, whoever reaps
it. Of a peer elsewhere (another machine, not Linux) nothing is known here; its heartbeat's
silence tells instead.
"""

from __future__ import annotations

import functools
import os
import signal
from dataclasses import dataclass


@functools.cache
def this_machine() -> str:
    """The boot id and pid namespace of this process (empty where ``/proc`` has neither)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def _state_and_start(pid: int) -> tuple[str, int] | None:
    """The state letter and start time (clock ticks after boot) of process ``pid``."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # (the name may hold spaces)
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


@dataclass(frozen=True)
class ProcessId:
    """One process: its machine (see :func:`this_machine`), pid and start time."""

    machine: str
    pid: int
    started: int

    def __str__(self) -> str:
        return f"{self.machine}/{self.pid}/{self.started}"

    @classmethod
    def parse(cls, text: str) -> ProcessId:
        machine, pid, started = text.rsplit("/", 2)
        return cls(machine, int(pid), int(started))

    @property
    def local(self) -> bool:
        """Whether this process runs where the caller does (same machine and pid space)."""
        return bool(self.machine) and self.machine == this_machine()

    def ended(self) -> bool:
        """Whether this process (on this machine) ended: gone, or a zombie not yet reaped."""
        found = _state_and_start(self.pid)
        return found is None or found[0] in "ZX" or found[1] != self.started

    def kill(self) -> None:
        """SIGKILL this process (on this machine), unless it ended already."""
        if not self.ended():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except OSError:
                pass  # it ended meanwhile


def this_process() -> ProcessId:
    """The identity of the calling process."""
    found = _state_and_start(os.getpid())
    return ProcessId(this_machine() if found else "", os.getpid(), found[1] if found else 0)
