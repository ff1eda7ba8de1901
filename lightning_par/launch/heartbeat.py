"""One rank's heartbeat in its group's store: it beats, watches its peers, and reports the
one that went silent (the why: :mod:`.liveness`).

:class:`Heartbeat` counts up ``lightning_par/beat/<rank>`` in the store from a thread of its
own, about four times per limit, and hands a watched peer whose count has not moved for the
limit to its ``on_dead`` (by default :func:`report_and_exit`, with :func:`silent_report`'s
words). A rank that finished a stage adds a large number to its count
(:meth:`Heartbeat.finish`, undone by :meth:`Heartbeat.resume`), and so does a rank the job
goes on without (:meth:`Heartbeat.forget`). Each rank also publishes its process
(``lightning_par/proc/<rank>``, :mod:`.process_id`) and learns its peers', which tells it
when the store's own process ended (:meth:`Heartbeat.store_gone`). Which heartbeat is this
process's, and its start and end with the group, is :mod:`.liveness`'s.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from lightning_par.launch import peer_loss
from lightning_par.launch.lost import LAUNCHER_RANK_ENV, leave_report
from lightning_par.launch.process_id import ProcessId, this_process
from lightning_par.launch.rendezvous import DEAD_PEER_ENV, KEPT_STORE_ENV, store_host_rank

#: Added to a rank's count when it finished a stage (counts stay far below it).
_DONE = 1 << 40
#: Seconds after joining a group during which a rank looks, every ``_LEARN_EVERY_S``, for
#: the processes its peers publish (later: at each beat).
_LEARN_S, _LEARN_EVERY_S = 5.0, 0.02


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
        survive: asked first about a silent rank (with the report); True: the job goes on
            without it (it is no longer watched), e.g. a parameter server whose shard a
            copy takes over.
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        watched: Iterable[int],
        dead_after_s: float,
        name: Callable[[int], str] = lambda r: f"rank {r}",
        on_dead: Callable[[int, str], None] | None = None,
        survive: Callable[[int, str], bool] | None = None,
    ) -> None:
        self.store, self.rank, self.dead_after_s, self.name = store, rank, dead_after_s, name
        self.survive = survive
        self.watched = [r for r in watched if r != rank]
        self.on_dead = on_dead or partial(report_and_exit, name(rank))
        self.interval_s = max(0.05, min(1.0, dead_after_s / 4))
        #: the processes of the watched peers, as each publishes its own (see the docstring)
        self.peers: dict[int, ProcessId] = {}
        self.seen: dict[int, tuple[int, float]] = {}  # peer -> (count, when it last moved)
        owner = os.environ.get(LAUNCHER_RANK_ENV, "")
        # the rank whose end ends the store: popen's launching rank (unless its keeper
        # serves the store), or rank 0 under SLURM
        self._store_owner = int(owner) if owner.isdigit() else store_host_rank()
        if os.environ.get(KEPT_STORE_ENV):
            self._store_owner = None
        self._owner_killed = False  # this process killed the store's rank (see killing)
        self._stop = threading.Event()
        self._finished = False
        self.store_failed = False
        self._reported: set[int] = set()  # peers handed to on_dead
        self._thread = threading.Thread(target=self._run, daemon=True, name="lp-heartbeat")

    def start(self) -> Heartbeat:
        self.store.set(self.key(self.rank, "proc"), str(this_process()))
        self._beat()
        self._learn_peers()
        self._thread.start()
        return self

    def key(self, rank: int, what: str = "beat") -> str:
        """The key of ``rank``'s count (``beat``) or process (``proc``) in the group's store."""
        return f"lightning_par/{what}/{rank}"

    def _beat(self) -> None:
        self.store.add(self.key(self.rank), 1)

    def finish(self) -> None:
        """This rank ended its stage: peers stop watching it (and it stops watching)."""
        if not self._finished:
            self._finished = True
            self.safely(lambda: self.store.add(self.key(self.rank), _DONE))

    def resume(self) -> None:
        """This rank joins the next stage of the same group: watched again."""
        if self._finished:
            self._finished = False
            self.safely(lambda: self.store.add(self.key(self.rank), -_DONE))

    def finished_stage(self, peer: int) -> bool:
        """Whether ``peer`` finished its stage (or was forgotten); once the store is gone,
        as last seen."""
        count = self.safely(lambda: self.store.add(self.key(peer), 0))
        if count is None:
            count = self.seen.get(peer, (0, 0.0))[0]
        return count >= _DONE // 2

    def forget(self, rank: int, report: str = "") -> None:
        """The job goes on without ``rank`` (a lost worker): no peer watches it any more.
        ``report`` (how it was lost) is left for the ranks that name a lost peer, should the
        job end after all (torchrun's agent ends it as soon as any of its processes ends):
        :func:`~.peer_loss.handed_over`."""
        self.safely(lambda: self.store.add(self.key(rank), _DONE))
        if report:
            peer_loss.hand_over(self, rank, report)

    def watch(self, rank: int) -> None:
        """A process joined the group (a lost rank's replacement): watch it too."""
        if rank != self.rank and rank not in self.watched:
            self.watched.append(rank)

    def hand_silent_peers_to(self, handler: Callable[[int, str], bool]) -> None:
        """From now on a silent peer is asked about first (``survive``): a fault-tolerant
        group goes on without it, the others still watched."""
        self.survive = handler

    def stop(self) -> None:
        self.finish()
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            # wait for a store call in flight: a thread still inside the store while the
            # interpreter exits aborts the process ("terminate called without an active
            # exception", seen at the end of a popen job)
            self._thread.join(timeout=self.interval_s + 2.0)

    def safely(self, action: Callable[[], Any]) -> Any:
        """``action()`` on the store, or None where the store is gone."""
        if self.store_gone():
            return None
        try:
            return action()
        except Exception:
            return None  # the store's host is gone: gloo reports that job's end itself

    def store_gone(self) -> bool:
        """Whether the process that holds the store (``popen``'s launching rank, rank 0
        under SLURM) ended."""
        if self._owner_killed:
            return True
        owner = self.peers.get(self._store_owner) if self._store_owner is not None else None
        return owner is not None and owner.local and owner.ended()

    def killing(self, peer: int) -> None:
        """This process is about to SIGKILL ``peer``. Its sockets close a moment before it is
        seen to end, and a store call in that moment fails with torch's warning and stack
        printed on standard error: once the store's rank is killed, the store counts as gone
        at once."""
        if peer == self._store_owner:
            self._owner_killed = True

    def _learn_peers(self) -> bool:
        """Read the process of each watched peer that published it; whether some did not."""
        for peer in self.watched:
            key = self.key(peer, "proc")
            if peer not in self.peers and self.store.check([key]):
                self.peers[peer] = ProcessId.parse(self.store.get(key).decode())
        return len(self.peers) < len(self.watched)

    def _run(self) -> None:
        # the peers publish their processes as they join, a moment apart: learn them at once
        # (the store may go with a lost peer: popen's rank 0); beat and watch every interval
        learn_until = time.monotonic() + _LEARN_S
        next_beat = time.monotonic() + self.interval_s
        try:
            while True:
                learning = len(self.peers) < len(self.watched)
                now = time.monotonic()
                wait = _LEARN_EVERY_S if learning and now < learn_until else next_beat - now
                if self._stop.wait(max(0.0, wait)) or self.store_gone():
                    return
                if learning:
                    self._learn_peers()
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self.interval_s
                    self._beat()
                    self._watch()
        except Exception:
            self.store_failed = True  # the store's host is gone: gloo reports the job's end

    def _watch(self) -> None:
        """Hand a watched peer silent for ``dead_after_s`` to ``on_dead`` (once each)."""
        if self._finished:
            self.seen.clear()
            return
        now = time.monotonic()
        for peer in list(self.watched):
            if self.store_gone():  # (on_dead may have killed the store's rank just now)
                return
            count = self.store.add(self.key(peer), 0)
            last = self.seen.get(peer)
            if count >= _DONE // 2 or last is None or last[0] != count:
                self.seen[peer] = (count, now)
            elif now - last[1] > self.dead_after_s and peer not in self._reported:
                report = silent_report(self.name(peer), now - last[1], self.dead_after_s)
                if self.survive is not None and self.survive(peer, report):
                    self.watched.remove(peer)  # a fault-tolerant group goes on without it
                    continue
                # (beating on: a handler that lets this rank live must not make it look
                # silent in turn)
                self._reported.add(peer)
                self.on_dead(peer, report)


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
