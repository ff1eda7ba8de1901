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
from typing import Any

from lightning_par import _compat
from lightning_par.launch import liveness
from lightning_par.launch.faults import planned_fault

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
    store = _store()
    if store is None:
        return None
    deadline = time.monotonic() + grace_s
    while True:
        try:
            if store.check([FAULT_KEY]):
                return store.get(FAULT_KEY).decode()
        except Exception:
            return None  # the store's host (worker 0) is gone
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)


def explain(message: str) -> str:
    """``message`` and, if a server reported one, its diagnosis."""
    fault = reported_fault()
    return message if not fault or fault in message else f"{message}\n{fault}"


def with_fault(server: int, rule: Any) -> Any:
    """``rule`` or, where a planned fault strikes this server, ``rule`` after the fault."""
    fault = planned_fault()
    if fault is None or fault.server != server:
        return rule

    def struck(comm, shard, step):
        if fault.due(step, server=server):
            fault.strike()
        return rule(comm, shard, step)

    return struck
