"""Letting a fork-launched run go on when a worker other than rank 0 dies.

Lightning's launcher joins its ranks with torch's ``ProcessContext.join``, which kills every
rank as soon as one exits with an error. A strategy whose workers never wait for each other
(``async_sgd``) can finish without a lost worker, so for it the launch joins the ranks
here instead: a rank other than 0 that dies abruptly (killed, ``os._exit``: no Python error
left in its error file) is reported and left behind; a Python error raised in any rank
stops every rank as before;
rank 0 (logging, checkpoints, the servers' parent) ending with an error ends the job as
before, with a message that says so.

Every fork launch also joins with a short grace period (:data:`GRACE_S`): once a rank
failed, torch waits 30 s after SIGTERM for the others by default, and a frozen rank (see
:mod:`lightning_par.launch.liveness`) ignores SIGTERM.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.multiprocessing as tmp

from lightning_par import _compat


def _join(context: Any, timeout: float | None = None, grace_period: float | None = None) -> bool:
    if not context.sentinels:
        return True
    ready = multiprocessing.connection.wait(list(context.sentinels), timeout=timeout)
    for sentinel in ready:
        index = context.sentinels[sentinel]
        process = context.processes[index]
        process.join()
        if process.exitcode == 0:
            context.sentinels.pop(sentinel)
        elif index != 0 and not os.path.exists(context.error_files[index]):
            context.sentinels.pop(sentinel)  # died abruptly: a lost worker
            print(
                f"lightning_par: worker {index} (rank {index}) died (exit code "
                f"{process.exitcode}); the other workers go on without it",
                file=sys.stderr, flush=True,
            )  # fmt: skip
        else:  # rank 0, or an error raised in a rank (a bug to show, not a lost worker)
            try:
                return type(context).join(context, timeout, grace_period)  # kills the rest
            except tmp.ProcessExitedException as err:
                raise RuntimeError(
                    f"lightning_par: worker 0 (rank 0: logging, checkpoints and the parameter "
                    f"servers) died (exit code {process.exitcode}); the job ends without it "
                    f"(the other ranks were stopped)"
                ) from err
    return not context.sentinels


#: Seconds torch's join gives the other ranks to end on their own, then again after SIGTERM,
#: once one rank failed (torch's default is 30 s after SIGTERM, which a frozen rank ignores).
GRACE_S = 3.0


@contextmanager
def tolerate_lost_workers(enabled: bool) -> Iterator[None]:
    """While a fork launch starts its ranks, join them with a short grace period, and with
    :func:`_join` (lost workers left behind) if ``enabled``."""

    def quick(context: Any) -> Any:
        joiner = _join if enabled else type(context).join

        def join(timeout: float | None = None, grace_period: float | None = None) -> bool:
            return joiner(context, timeout, GRACE_S if grace_period is None else grace_period)

        context.join = join
        return context

    with _compat.patched_start_processes(quick):
        yield
