"""What the main process does when a launch fails or is interrupted (Ctrl-C, Jupyter's
"interrupt kernel", SIGTERM from a scheduler) or loses a rank: SIGTERM is handled like
Ctrl-C, every rank still running is stopped with what it started, and one line names the
newest checkpoint (and the lost rank: :mod:`._lost_ranks`)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_par.launch.lost import RankLost
from lightning_par.launch.processes import stop_process_groups


class Terminated(KeyboardInterrupt):
    """SIGTERM in the main process, handled like Ctrl-C."""


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While inside (in the main thread), SIGTERM raises :class:`Terminated`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def newest_checkpoint(root: str | os.PathLike, since: float) -> Path | None:
    """The newest ``*.ckpt`` under ``root`` written after ``since`` (a ``time.time()``)."""
    found = [p for p in Path(root).rglob("*.ckpt") if p.stat().st_mtime >= since]
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


def alive(proc: Any) -> bool:
    """Whether a rank (a ``Popen`` or a ``multiprocessing.Process``) still runs."""
    poll = getattr(proc, "poll", None)
    return proc.poll() is None if poll is not None else proc.is_alive()


def stop_ranks(procs: list[Any], trainer: pl.Trainer | None, error: BaseException,
               started: float) -> None:  # fmt: skip
    """Stop every rank still running and what it started; after an interrupt, say so and
    name the newest checkpoint the run wrote since ``started`` (a ``time.time()``)."""
    running = [p for p in procs if alive(p)]
    stop_process_groups(running)
    if not isinstance(error, KeyboardInterrupt):
        return
    what = "SIGTERM" if isinstance(error, Terminated) else "an interrupt"
    message = f"lightning_par: stopped every rank after {what}"
    if running:
        message += f" ({len(running)} still running were killed)"
    print(message + checkpoint_clause(trainer, started), flush=True)


def checkpoint_clause(trainer: pl.Trainer | None, started: float) -> str:
    """``; the newest checkpoint is PATH`` (written since ``started``, a ``time.time()``,
    under the trainer's root or a ``ModelCheckpoint``'s folder), or ``; no checkpoint was
    saved``."""
    roots = {trainer.default_root_dir} if trainer is not None else set()
    for callback in trainer.checkpoint_callbacks if trainer is not None else []:
        if getattr(callback, "dirpath", None):
            roots.add(callback.dirpath)
    found = [c for c in (newest_checkpoint(r, started) for r in roots if r) if c is not None]
    checkpoint = max(found, key=lambda p: p.stat().st_mtime, default=None)
    return f"; the newest checkpoint is {checkpoint}" if checkpoint else "; no checkpoint was saved"


def lost_rank_message(lost: RankLost, trainer: pl.Trainer | None, started: float) -> str:
    """The one line that names a lost rank: who, how, and the newest checkpoint."""
    return f"{lost}; every rank was stopped{checkpoint_clause(trainer, started)}"
