"""Dead-peer detection that does not depend on the timeout: a heartbeat per rank.

The process-group timeout must be long (a rank may spend minutes writing a checkpoint or
compiling its first step while its peers wait in a collective), yet a peer that is gone
must be reported in seconds. gloo reports a peer whose connection *closed* at once; this
module covers the peer that went silent without closing anything (its process frozen,
its machine or network gone): every rank counts up a key in the group's store about four
times per limit, from a background thread that keeps beating while the rank computes,
sleeps or writes; a rank whose count has not moved for :func:`dead_peer_timeout` seconds
is reported, naming it, and the watching rank ends (a blocked collective cannot be
interrupted from Python; the launcher then stops the rest). Under a launch of this project
the report goes to the launcher, which says it in one line (:mod:`.lost`); elsewhere
(torchrun, SLURM) the watching rank prints it.

A rank that finished a stage (``teardown``) says so (:meth:`Heartbeat.finish`) and is no
longer watched until it joins the next stage (:meth:`Heartbeat.resume`); a rank the job
goes on without (a lost ``async_sgd`` worker) is forgotten (:meth:`Heartbeat.forget`).

A peer whose process *ended* closes its connections, and the collective waiting on it fails
at once with gloo's "Connection reset by peer", which names no rank. Each rank also
publishes which process it is (:mod:`.process_id`), so that a rank whose collective failed
can name the peer that ended without finishing its stage (:meth:`Heartbeat.lost_peer`): at
once on the same machine, and on another one when its beat stops. Under a ``popen`` launch
the store lives as long as the launching process (rank 0): once that process is gone, the
others stop using the store (torch would print a C++ stack for each call on the dead
connection).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from typing import Any

from lightning_par.launch.lost import LAUNCHER_RANK_ENV, leave_report
from lightning_par.launch.process_id import ProcessId, this_process
from lightning_par.launch.rendezvous import DEAD_PEER_ENV, dead_peer_timeout

#: Added to a rank's count when it finished a stage (counts stay far below it).
_DONE = 1 << 40
#: Seconds between a peer's connection closing and its process being seen to end (the
#: kernel closes a process's sockets a moment before it becomes a zombie).
_EXIT_WINDOW_S = 0.5
#: Where a process leaves the report of a lost peer for the ranks that name it.
_HANDED_KEY = "lightning_par/handed-over"
#: Seconds a rank waits, as it joins a group, for its peers to say which process they are.
_LEARN_S = 5.0
#: Beats a peer on another machine may miss, after a collective failed, before it counts as
#: ended (a live process beats from a thread of its own, whatever its main thread does).
_MISSED_BEATS = 3


class Heartbeat:
    """Beat for ``rank`` in ``store`` and watch ``watched`` ranks (see the module docstring).

    Args:
        store: the group's key-value store (every rank of the group reaches it).
        rank: this process's rank in the group.
        watched: ranks whose silence ends this rank (e.g. not the workers async SGD can lose).
        dead_after_s: seconds without a beat after which a watched rank is reported.
        name: how to name a rank in the report (``"worker 1 (rank 1)"``).
        on_dead: called with the silent rank and the report, instead of
            :func:`report_and_exit`.
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        watched: Iterable[int],
        dead_after_s: float,
        name: Callable[[int], str] = lambda r: f"rank {r}",
        on_dead: Callable[[int, str], None] | None = None,
    ) -> None:
        self.store, self.rank, self.dead_after_s, self.name = store, rank, dead_after_s, name
        self.watched = [r for r in watched if r != rank]
        self.on_dead = on_dead or partial(report_and_exit, name(rank))
        self.interval_s = max(0.05, min(1.0, dead_after_s / 4))
        #: the processes of the watched peers, as each publishes its own (see the docstring)
        self.peers: dict[int, ProcessId] = {}
        self._seen: dict[int, tuple[int, float]] = {}  # peer -> (count, when it last moved)
        owner = os.environ.get(LAUNCHER_RANK_ENV, "")
        self._store_owner = int(owner) if owner.isdigit() else None  # popen: the store's rank
        self._stop = threading.Event()
        self._finished = False
        self._store_failed = False
        self._reported: set[int] = set()  # peers handed to on_dead
        self._thread = threading.Thread(target=self._run, daemon=True, name="lp-heartbeat")

    def start(self) -> Heartbeat:
        self.store.set(self._key(self.rank, "proc"), str(this_process()))
        self._beat()
        # the peers publish theirs as they join, a moment apart: know them before the first
        # step (the store may go with a lost peer: popen's rank 0)
        deadline = time.monotonic() + min(self.dead_after_s, _LEARN_S)
        while self._learn_peers() and time.monotonic() < deadline:
            time.sleep(0.01)
        self._thread.start()
        return self

    def _key(self, rank: int, what: str = "beat") -> str:
        return f"lightning_par/{what}/{rank}"

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

    def forget(self, rank: int, report: str = "") -> None:
        """The job goes on without ``rank`` (a lost worker): no peer watches it any more.
        ``report`` (how it was lost) is left for the ranks that name a lost peer, should the
        job end after all (torchrun's agent ends it as soon as any of its processes ends):
        :meth:`handed_over`."""
        self._safely(lambda: self.store.add(self._key(rank), _DONE))
        if report:
            self._hand_over(rank, report)

    def stop(self) -> None:
        self.finish()
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            # wait for a store call in flight: a thread still inside the store while the
            # interpreter exits aborts the process ("terminate called without an active
            # exception", seen at the end of a popen job)
            self._thread.join(timeout=self.interval_s + 2.0)

    def _safely(self, action: Callable[[], Any]) -> Any:
        if self._store_gone():
            return None
        try:
            return action()
        except Exception:
            return None  # the store's host is gone: gloo reports that job's end itself

    def _store_gone(self) -> bool:
        """Whether the process that holds the store (``popen``'s rank 0) ended."""
        owner = self.peers.get(self._store_owner) if self._store_owner is not None else None
        return owner is not None and owner.local and owner.ended()

    def _learn_peers(self) -> bool:
        """Read the process of each watched peer that published it; whether some did not."""
        for peer in self.watched:
            key = self._key(peer, "proc")
            if peer not in self.peers and self.store.check([key]):
                self.peers[peer] = ProcessId.parse(self.store.get(key).decode())
        return len(self.peers) < len(self.watched)

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval_s):
                if self._store_gone():
                    return
                self._beat()
                if len(self.peers) < len(self.watched):
                    self._learn_peers()
                if self._finished:
                    self._seen.clear()
                    continue
                now = time.monotonic()
                for peer in self.watched:
                    count = self.store.add(self._key(peer), 0)
                    last = self._seen.get(peer)
                    if count >= _DONE // 2 or last is None or last[0] != count:
                        self._seen[peer] = (count, now)
                    elif now - last[1] > self.dead_after_s and peer not in self._reported:
                        # (beating on: a handler that lets this rank live must not make it
                        # look silent in turn)
                        self._reported.add(peer)
                        self.on_dead(peer, silent_report(self.name(peer), now - last[1],
                                                         self.dead_after_s))  # fmt: skip
        except Exception:
            self._store_failed = True  # the store's host is gone: gloo reports the job's end

    # ---- after a collective failed -------------------------------------------------------------
    def lost_peer(self) -> tuple[int, str] | None:
        """After a collective of this rank failed: a watched peer whose process ended without
        finishing its stage, with a report naming it, or None (no peer ended: the failure
        is this rank's own, or a peer's that raised). Waits at most about a second on one
        machine, a few beats for a peer on another."""
        remote = [p for p in self.watched if p not in self.peers or not self.peers[p].local]
        wait_s = _EXIT_WINDOW_S + (_MISSED_BEATS * self.interval_s if remote else 0.0)
        deadline = time.monotonic() + wait_s
        while True:
            for peer in self.watched:
                process = self.peers.get(peer)
                if process is not None and process.local and process.ended():
                    how = f", process {process.pid}, ended {_ENDED_HOW}"
                elif peer in remote and self._stopped_beating(peer):
                    how = " stopped beating as its connection closed (its process was killed "
                    how += "or ended without raising an error, or its machine is gone)"
                else:
                    continue
                if not self._peer_finished(peer):
                    return peer, f"{self.name(peer)}{how}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _stopped_beating(self, peer: int) -> bool:
        last = self._seen.get(peer)
        missed = _MISSED_BEATS * self.interval_s
        fresh = not self._store_failed  # (else what was last seen is stale)
        return fresh and last is not None and time.monotonic() - last[1] > missed

    def _peer_finished(self, peer: int) -> bool:
        count = self._safely(lambda: self.store.add(self._key(peer), 0))
        if count is None:  # (the store is gone: what was last seen)
            count = self._seen.get(peer, (0, 0.0))[0]
        return count >= _DONE // 2

    def hand_over_silent(self, peer: int, report: str) -> bool:
        """Where no launcher of this project names a silent ``peer``: leave ``report`` for
        the ranks that name it (:meth:`handed_over`: a server finds an ``async_sgd`` worker
        silent that no worker watches) and SIGKILL the peer if it runs on this machine, so
        that the collectives waiting on it fail at once; whether it was killed."""
        self._hand_over(peer, report)
        process = self.peers.get(peer)
        if process is None or not process.local:
            return False
        process.kill()
        return True

    def _hand_over(self, peer: int, report: str) -> None:
        store = self.store  # (the first report stands: a second is the echo of the first)
        self._safely(
            lambda: store.check([_HANDED_KEY]) or store.set(_HANDED_KEY, f"{peer}\n{report}")
        )

    def handed_over(self) -> tuple[int, str] | None:
        """The lost peer a process of this group handed over (silent, or dropped by a
        server), with its report, if one did."""
        store = self.store
        found = self._safely(lambda: store.check([_HANDED_KEY]) and store.get(_HANDED_KEY))
        if not found:
            return None
        rank, report = found.decode().split("\n", 1)
        return int(rank), report

    def first_to_report(self) -> bool:
        """Whether this rank is the first of its group to report a lost peer (every rank
        that sees the loss would otherwise print the same line)."""
        count = self._safely(lambda: self.store.add("lightning_par/reported", 1))
        return count is None or count == 1


#: How a peer that ended without finishing its stage was lost, as far as its peers can know
#: (its exit code goes only to its parent: torchrun's agent prints it in its table).
_ENDED_HOW = "without raising an error (killed by a signal, as the OOM killer does, or os._exit)"


def silent_report(who: str, silent_s: float, limit_s: float) -> str:
    """How a report names a rank that stopped beating: who, for how long, and the limit."""
    return (
        f"{who} stopped responding for {silent_s:.0f} s (its process frozen, or its machine "
        f"or network gone; the limit is dead_peer_timeout={limit_s:g} s, an option of every "
        f"strategy, or {DEAD_PEER_ENV})"
    )


def report_and_exit(reporter: str, peer: int, report: str) -> None:
    """End this process, a rank blocked behind the silent ``peer``: its launcher reports it
    (:func:`~lightning_par.launch.lost.leave_report`), or this process prints it."""
    if not leave_report(peer, report):
        print(f"lightning_par: {report}; {reporter} ends the job", file=sys.stderr, flush=True)
    os._exit(1)


_current: Heartbeat | None = None  # the heartbeat of this process's default group
_last: Heartbeat | None = None  # the one before, once stopped (see store_gone)
_handler: Callable[[int, str], None] | None = None  # see silent_peers_handed_to


@contextmanager
def silent_peers_handed_to(handler: Callable[[int, str], None]) -> Iterator[None]:
    """While inside, a silent peer this process's group heartbeat finds is handed to
    ``handler(rank, report)`` instead of ending the process: the launching process of a
    ``popen`` launch is rank 0, and stops its other ranks itself."""
    global _handler
    previous, _handler = _handler, handler
    try:
        yield
    finally:
        _handler = previous


def watch_group(
    store: Any,
    rank: int,
    watched: Iterable[int],
    timeout: timedelta | None = None,
    name: Callable[[int], str] = lambda r: f"rank {r}",
    dead_after_s: float | None = None,
) -> Heartbeat:
    """Start the heartbeat of the group this process just joined (ending the previous
    group's); peers silent for ``dead_after_s`` (default
    :func:`~lightning_par.launch.rendezvous.dead_peer_timeout`; at most the group's
    ``timeout``) end the job."""
    global _current
    if _current is not None:
        _current.stop()
    else:  # runs before the process group is destroyed at exit (atexit is last-in first-out)
        atexit.register(stop_watching)
    limit = dead_peer_timeout(timeout, dead_after_s)
    _current = Heartbeat(store, rank, watched, limit, name, on_dead=_handler).start()
    return _current


def current() -> Heartbeat | None:
    """The heartbeat of this process's group (``None`` when none runs)."""
    return _current


def store_gone() -> bool:
    """Whether the process that holds the store of this process's (last) group ended
    (``popen``'s rank 0): a call on that store would fail, printing torch's C++ stack first."""
    beat = _current or _last
    return beat is not None and beat._store_gone()


def stop_watching() -> None:
    """The group ends (``destroy_process_group``): stop its heartbeat."""
    global _current, _last
    if _current is not None:
        _current.stop()
        _current, _last = None, _current
