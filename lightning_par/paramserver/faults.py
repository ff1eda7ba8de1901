"""Naming who failed: a server's diagnosis reaches the workers through the rendezvous store.

When a worker hangs, the only process that knows which one is a server (it holds worker
0's header for the step and waits for the others'), yet the error the user sees comes from
a worker (the one whose pull or collective timed out). So a failing server writes its
message into the process group's key-value store (hosted by worker 0, reachable from every
rank without the failed peer) and a failing worker adds what it finds there to its own.

Also a test hook: ``LIGHTNING_PAR_PS_TEST_EXIT="server,step"`` makes that server process
exit abruptly when step ``step`` begins, as a crashed server would.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from lightning_par import _compat

FAULT_KEY = "lightning_par/paramserver/fault"
TEST_EXIT_ENV = "LIGHTNING_PAR_PS_TEST_EXIT"


def _store() -> Any:
    """The default group's store, or None (no group). Runs while another error is being
    reported, so a moved torch name is printed rather than raised over that error."""
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


def with_test_exit(server: int, rule: Any) -> Any:
    """``rule`` or, under the test hook for this server, one that exits at the given step."""
    spec = os.environ.get(TEST_EXIT_ENV)
    if not spec:
        return rule
    target, at_step = (int(x) for x in spec.split(","))
    if target != server:
        return rule

    def exiting(comm, shard, step):
        if step == at_step:
            os._exit(7)
        return rule(comm, shard, step)

    return exiting
