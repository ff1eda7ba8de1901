"""After a rank failed: which peer the job lost, where no launcher of this project can say it
(torchrun, SLURM, the scripts of a ``popen`` launch that lost rank 0).

A peer whose process *ended* closes its connections, and the collective waiting on it fails
at once with gloo's "Connection reset by peer", which names no rank; its exit code goes only
to its parent (torchrun's agent prints it in its table). Each rank's heartbeat
(:class:`~lightning_par.launch.heartbeat.Heartbeat`) knows its peers' processes
(:mod:`.process_id`) and when each last beat, so :func:`lost_peer` names the peer that ended
without finishing its stage: at once on the same machine, after a few missed beats on
another. A process that finds a peer lost that no rank watches (a parameter server drops or
finds silent an ``async_sgd`` worker) hands it over to the ranks in the group's store
(:func:`hand_over`, :func:`handed_over`); :func:`first_to_report` keeps the line to one per
job. The functions take the heartbeat of the group (``beat``).
"""

from __future__ import annotations

import time
from typing import Any

#: Seconds between a peer's connection closing and its process being seen to end (the
#: kernel closes a process's sockets a moment before it becomes a zombie).
_EXIT_WINDOW_S = 0.5
#: Beats a peer on another machine may miss, after a collective failed, before it counts as
#: ended (a live process beats from a thread of its own, whatever its main thread does).
_MISSED_BEATS = 3
#: Where a process leaves the report of a lost peer for the ranks that name it.
_HANDED_KEY = "lightning_par/handed-over"
#: How a peer that ended without finishing its stage was lost, as far as its peers can know.
_ENDED_HOW = "without raising an error (killed by a signal, as the OOM killer does, or os._exit)"


def lost_peer(beat: Any) -> tuple[int, str] | None:
    """After a collective of this rank failed: a watched peer whose process ended without
    finishing its stage, with a report naming it, or None (no peer ended: the failure
    is this rank's own, or a peer's that raised). Waits at most about a second on one
    machine, a few beats for a peer on another."""
    remote = [p for p in beat.watched if p not in beat.peers or not beat.peers[p].local]
    wait_s = _EXIT_WINDOW_S + (_MISSED_BEATS * beat.interval_s if remote else 0.0)
    deadline = time.monotonic() + wait_s
    while True:
        for peer in beat.watched:
            process = beat.peers.get(peer)
            if process is not None and process.local and process.ended():
                how = f", process {process.pid}, ended {_ENDED_HOW}"
            elif peer in remote and _stopped_beating(beat, peer):
                how = " stopped beating as its connection closed (its process was killed "
                how += "or ended without raising an error, or its machine is gone)"
            else:
                continue
            if not beat.finished_stage(peer):
                return peer, f"{beat.name(peer)}{how}"
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def _stopped_beating(beat: Any, peer: int) -> bool:
    last = beat.seen.get(peer)
    missed = _MISSED_BEATS * beat.interval_s
    fresh = not beat.store_failed  # (else what was last seen is stale)
    return fresh and last is not None and time.monotonic() - last[1] > missed


def hand_over_silent(beat: Any, peer: int, report: str) -> bool:
    """Where no launcher of this project names a silent ``peer``: leave ``report`` for
    the ranks that name it (:func:`handed_over`: a server finds an ``async_sgd`` worker
    silent that no worker watches) and SIGKILL the peer if it runs on this machine, so
    that the collectives waiting on it fail at once; whether it was killed."""
    hand_over(beat, peer, report)
    process = beat.peers.get(peer)
    if process is None or not process.local:
        return False
    beat.killing(peer)
    process.kill()
    return True


def hand_over(beat: Any, peer: int, report: str) -> None:
    """Leave ``report`` (how ``peer`` was lost) for the ranks of the group that name it; the
    first report stands (a second is the echo of the first)."""
    store = beat.store
    beat.safely(lambda: store.check([_HANDED_KEY]) or store.set(_HANDED_KEY, f"{peer}\n{report}"))


def handed_over(beat: Any) -> tuple[int, str] | None:
    """The lost peer a process of this group handed over (silent, or dropped by a
    server), with its report, if one did."""
    store = beat.store
    found = beat.safely(lambda: store.check([_HANDED_KEY]) and store.get(_HANDED_KEY))
    if not found:
        return None
    rank, report = found.decode().split("\n", 1)
    return int(rank), report


def first_to_report(beat: Any) -> bool:
    """Whether this rank is the first of its group to report a lost peer (every rank
    that sees the loss would otherwise print the same line)."""
    count = beat.safely(lambda: beat.store.add("lightning_par/reported", 1))
    return count is None or count == 1
