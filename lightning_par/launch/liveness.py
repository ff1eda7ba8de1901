"""Dead-peer detection that does not depend on the timeout: a heartbeat per rank.

The process-group timeout must be long (a rank may spend minutes writing a checkpoint or
compiling its first step while its peers wait in a collective), yet a peer that is gone
must be reported in seconds. gloo reports a peer whose connection *closed* at once; this
module covers the peer that went silent without closing anything (its process frozen,
its machine or network gone): every rank counts up a key in the group's store about four
times per limit, from a background thread that keeps beating while the rank computes,
sleeps or writes; a rank whose count has not moved for :func:`dead_peer_timeout` seconds
is reported, naming it, and the watching rank ends (a blocked collective cannot be
interrupted from Python; the launcher then stops the rest).

A rank that finished a stage (``teardown``) says so (:meth:`Heartbeat.finish`) and is no
longer watched until it joins the next stage (:meth:`Heartbeat.resume`).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

from lightning_par.launch.rendezvous import dead_peer_timeout

#: Added to a rank's count when it finished a stage (counts stay far below it).
_DONE = 1 << 40


class Heartbeat:
    """Beat for ``rank`` in ``store`` and watch ``watched`` ranks (see the module docstring).

    Args:
        store: the group's key-value store (every rank of the group reaches it).
        rank: this process's rank in the group.
        watched: ranks whose silence ends this rank (e.g. not the workers async SGD can lose).
        dead_after_s: seconds without a beat after which a watched rank is reported.
        name: how to name a rank in the report (``"worker 1 (rank 1)"``).
        on_dead: called with the report instead of printing it and ending the process.
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        watched: Iterable[int],
        dead_after_s: float,
        name: Callable[[int], str] = lambda r: f"rank {r}",
        on_dead: Callable[[str], None] | None = None,
    ) -> None:
        self.store, self.rank, self.dead_after_s, self.name = store, rank, dead_after_s, name
        self.watched = [r for r in watched if r != rank]
        self.on_dead = on_dead or _report_and_exit
        self.interval_s = max(0.05, min(1.0, dead_after_s / 4))
        self._stop = threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="lp-heartbeat")

    def start(self) -> Heartbeat:
        self._beat()
        self._thread.start()
        return self

    def _key(self, rank: int) -> str:
        return f"lightning_par/beat/{rank}"

    def _beat(self) -> None:
        self.store.add(self._key(self.rank), 1)

    def finish(self) -> None:
        """This rank ended its stage: peers stop watching it (and it stops watching)."""
        if not self._finished:
            self._finished = True
            self._safely(lambda: self.store.add(self._key(self.rank), _DONE))

    def resume(self) -> None:
        """This rank joins the next stage of the same group: watched again."""
        if self._finished:
            self._finished = False
            self._safely(lambda: self.store.add(self._key(self.rank), -_DONE))

    def stop(self) -> None:
        self.finish()
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            # wait for a store call in flight: a thread still inside the store while the
            # interpreter exits aborts the process ("terminate called without an active
            # exception", seen at the end of a popen job)
            self._thread.join(timeout=self.interval_s + 2.0)

    def _safely(self, action: Callable[[], Any]) -> None:
        try:
            action()
        except Exception:
            pass  # the store's host is gone: gloo reports that job's end itself

    def _run(self) -> None:
        seen: dict[int, tuple[int, float]] = {}
        try:
            while not self._stop.wait(self.interval_s):
                self._beat()
                if self._finished:
                    seen.clear()
                    continue
                now = time.monotonic()
                for peer in self.watched:
                    count = self.store.add(self._key(peer), 0)
                    last = seen.get(peer)
                    if count >= _DONE // 2 or last is None or last[0] != count:
                        seen[peer] = (count, now)
                    elif now - last[1] > self.dead_after_s and not self._finished:
                        self.on_dead(
                            f"lightning_par: {self.name(peer)} has not answered for "
                            f"{now - last[1]:.0f} s (its process is frozen or its machine or "
                            f"network is gone); {self.name(self.rank)} ends the job"
                        )
                        return
        except Exception:
            return  # the store's host is gone: gloo reports that job's end itself


def _report_and_exit(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(1)


_current: Heartbeat | None = None  # the heartbeat of this process's default group


def watch_group(
    store: Any,
    rank: int,
    watched: Iterable[int],
    timeout: timedelta | None = None,
    name: Callable[[int], str] = lambda r: f"rank {r}",
) -> Heartbeat:
    """Start the heartbeat of the group this process just joined (ending the previous
    group's); peers silent for :func:`~lightning_par.launch.rendezvous.dead_peer_timeout`
    seconds (at most the group's ``timeout``) end the job."""
    global _current
    if _current is not None:
        _current.stop()
    else:  # runs before the process group is destroyed at exit (atexit is last-in first-out)
        atexit.register(stop_watching)
    limit = dead_peer_timeout(timeout)
    _current = Heartbeat(store, rank, watched, limit, name).start()
    return _current


def current() -> Heartbeat | None:
    """The heartbeat of this process's group (``None`` when none runs)."""
    return _current


def stop_watching() -> None:
    """The group ends (``destroy_process_group``): stop its heartbeat."""
    global _current
    if _current is not None:
        _current.stop()
        _current = None
