"""Naming who failed: a server's diagnosis reaches the workers through the rendezvous store.

When a worker hangs, the only process that knows which one is a server (it holds worker
0's header for the step and waits for the others'), yet the error the user sees comes from
a worker (the one whose pull or collective timed out). So a failing server writes its
message into the process group's key-value store (hosted by worker 0, reachable from every
rank without the failed peer) and a failing worker adds what it finds there to its own.

Also where a planned fault strikes a server (``LIGHTNING_PAR_FAULT="kill:server=1:step=3"``,
:mod:`lightning_par.launch.faults`): as that server's step begins, as a crashed server would.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from lightning_par import _compat
from lightning_par.launch import liveness
from lightning_par.launch.faults import planned_faults

FAULT_KEY = "lightning_par/paramserver/fault"


def _store() -> Any:
    """The default group's store, or None (no group, or its host is gone). Runs while another
    error is being reported, so a moved torch name is printed rather than raised over that
    error."""
    if liveness.store_gone():
        return None
    try:
        return _compat.default_store()
    except _compat.CompatError as err:
        print(f"lightning_par: cannot pass a server's diagnosis on: {err}", file=sys.stderr)
        return None
    except Exception:  # no process group (any more)
        return None


def record_fault(message: str) -> None:
    """Leave ``message`` for the workers (best effort: the store may be gone too)."""
    store = _store()
    if store is None:
        return
    try:
        store.set(FAULT_KEY, message)
    except Exception:
        pass


def reported_fault(grace_s: float = 3.0) -> str | None:
    """A server's message, waiting up to ``grace_s`` for it (a worker's own timeout can fire
    a moment before the server's, which started earlier)."""
    return _read(FAULT_KEY, grace_s)


def _read(key: str, grace_s: float) -> str | None:
    store = _store()
    if store is None:
        return None
    deadline = time.monotonic() + grace_s
    while True:
        try:
            if store.check([key]):
                return store.get(key).decode()
        except Exception:
            return None  # the store's host (worker 0) is gone
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)


#: Where the worker that started a server says how it ended (``fault_tolerant``).
LOST_KEY = "lightning_par/paramserver/lost/{}"


def record_lost(server: int, how: str) -> None:
    """Server ``server``'s process ended (``how``: "was killed by SIGKILL"): its peers may
    take a failed message from it for its loss (:func:`lost_server`)."""
    store = _store()
    if store is not None:
        try:
            store.set(LOST_KEY.format(server), how)
        except Exception:
            pass


def lost_server(server: int, grace_s: float = 5.0) -> str | None:
    """How server ``server``'s process ended, if it did (waiting up to ``grace_s`` for the
    worker that started it to say so: it sees the death within milliseconds), else None:
    a message that failed for another reason (a timeout) is no loss."""
    return _read(LOST_KEY.format(server), grace_s)


def explain(message: str) -> str:
    """``message`` and, if a server reported one, its diagnosis."""
    fault = reported_fault()
    return message if not fault or fault in message else f"{message}\n{fault}"


def with_fault(server: int, rule: Any) -> Any:
    """``rule`` or, where a planned fault strikes this server, ``rule`` after the fault."""
    strike = fault_of(server)
    if strike is None:
        return rule

    def struck(comm, shard, step):
        strike(step)
        return rule(comm, shard, step)

    return struck


def fault_of(server: int) -> Callable[[int], None] | None:
    """The check to make as each step of server ``server`` begins, if a planned fault
    strikes it (once: a frozen server that is let go again goes on)."""
    fault = next((f for f in planned_faults() if f.server == server), None)
    if fault is None:
        return None
    struck: list[int] = []

    def strike(step: int) -> None:
        if not struck and fault.due(step, server=server):
            struck.append(step)
            fault.strike()

    return strike


#: The first step at which worker 0 pushes lost worker ``w``'s gradient in its slot
#: (``fault_tolerant``).
COVERED_KEY = "lightning_par/paramserver/covered/{}"


def record_covered(worker: int, step: int) -> None:
    """Worker 0 trains lost ``worker``'s batch beside its own from ``step`` on and pushes its
    gradient in that worker's slot: a server that finds the worker lost at that step or later
    takes that slot's push from worker 0."""
    store = _store()
    if store is not None:
        store.set(COVERED_KEY.format(worker), str(step))


def covered_since(worker: int) -> int | None:
    """The step from which worker 0 pushes lost ``worker``'s gradient in its slot (None: not
    yet)."""
    found = _read(COVERED_KEY.format(worker), grace_s=0)
    return None if found is None else int(found)
