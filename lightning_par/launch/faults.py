"""Fault injection: kill, freeze or end one process of a job at a chosen step.

``LIGHTNING_PAR_FAULT="kill:rank=1:step=12"`` makes rank 1 send itself ``SIGKILL`` as its
training step 12 begins (``trainer.global_step == 12``: twelve optimiser steps done), as the
OOM killer or a preempted node would; ``freeze`` sends ``SIGSTOP`` instead (alive, its
connections open, silent: a hung machine), and ``exit`` ends the process with
``os._exit(code)`` (``code=N``, default 1), skipping every ``finally``. ``server=S`` in
place of ``rank=R`` strikes parameter server ``S`` as its step ``step`` begins; several
faults, separated by commas, strike several processes. The process
says what it does on standard error just before, so a log shows that the fault was made on
purpose.

Why an environment variable, not a callback: a fault happens *to* a script, so the script
stays as its user wrote it; the variable reaches every process of the job under every
launch (forked and forkserver ranks, ``popen``'s re-run scripts, torchrun and SLURM, the
parameter servers a worker starts), where a callback would reach neither the servers nor
a script one did not write (torchft's tests hand their training loop an event injector
object for the same purpose). The strategies read the variable once, in their constructor,
and check it as each training step begins; the parameter servers, as each step of theirs
begins.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass

#: The environment variable that plans a fault (see the module docstring).
FAULT_ENV = "LIGHTNING_PAR_FAULT"
#: What each kind of fault does to the process it strikes.
KINDS = {"kill": "SIGKILL", "freeze": "SIGSTOP", "exit": "os._exit"}
_FORM = "KIND:rank=R:step=S (or KIND:server=S:step=S, and :code=N for exit)"


@dataclass(frozen=True)
class Fault:
    """One planned fault: ``kind`` (``kill``, ``freeze``, ``exit``) striking ``rank`` (or
    parameter server ``server``) when its step ``step`` begins."""

    kind: str
    step: int
    rank: int | None = None
    server: int | None = None
    code: int = 1

    def due(self, step: int, rank: int | None = None, server: int | None = None) -> bool:
        """Whether this fault strikes rank ``rank`` (or server ``server``) at ``step``."""
        if step != self.step:
            return False
        return rank == self.rank if self.rank is not None else server == self.server

    def strike(self) -> None:
        """Do it to this process (``freeze`` returns once someone sends ``SIGCONT``)."""
        who = f"rank {self.rank}" if self.rank is not None else f"parameter server {self.server}"
        what = f"os._exit({self.code})" if self.kind == "exit" else KINDS[self.kind]
        print(
            f"lightning_par: {FAULT_ENV}: {who} (process {os.getpid()}) gets {what} as step "
            f"{self.step} begins",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        if self.kind == "exit":
            os._exit(self.code)
        os.kill(os.getpid(), signal.SIGKILL if self.kind == "kill" else signal.SIGSTOP)


def parse_fault(text: str) -> Fault:
    """The :class:`Fault` that ``text`` (``kill:rank=1:step=12``) plans; ``ValueError``
    naming the form otherwise."""
    kind, *fields = text.strip().split(":")
    try:
        values = dict(field.split("=", 1) for field in fields)
        numbers = {key: int(value) for key, value in values.items()}
    except ValueError:
        numbers = {}
    targets = {"rank", "server"} & set(numbers)
    allowed = {"rank", "server", "step"} | ({"code"} if kind == "exit" else set())
    if kind not in KINDS or len(targets) != 1 or "step" not in numbers or set(numbers) - allowed:
        raise ValueError(
            f"{FAULT_ENV}={text!r}: write {_FORM}, KIND one of {sorted(KINDS)}, e.g. "
            f"{FAULT_ENV}=kill:rank=1:step=12"
        )
    if min(numbers.values()) < 0:
        raise ValueError(f"{FAULT_ENV}={text!r}: ranks, servers and steps count from 0")
    return Fault(kind, **numbers)


def planned_faults() -> list[Fault]:
    """The faults :data:`FAULT_ENV` plans in this process's environment: none, one, or
    several separated by commas (``kill:rank=1:step=3,kill:server=0:step=3``: a worker and a
    parameter server lost in the same step)."""
    text = os.environ.get(FAULT_ENV, "")
    return [parse_fault(part) for part in text.split(",") if part.strip()]


def strike_due(faults: list[Fault], step: int, rank: int) -> None:
    """As rank ``rank``'s training step ``step`` begins: strike it with each of ``faults``
    due then (none, usually)."""
    for fault in faults:
        if fault.due(step, rank=rank):
            fault.strike()
