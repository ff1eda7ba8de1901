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

A rank that finished a stage (``teardown``) says so (:meth:`~.heartbeat.Heartbeat.finish`)
and is no longer watched until it joins the next stage (:meth:`~.heartbeat.Heartbeat.resume`);
a rank the job goes on without (a lost ``async_sgd`` worker) is forgotten
(:meth:`~.heartbeat.Heartbeat.forget`).

Each rank also publishes which process it is (:mod:`.process_id`) and learns its peers',
so that a rank whose collective failed can name the peer whose process ended
(:mod:`.peer_loss`). Under a ``popen`` launch the store lives as long as the launching
process (rank 0): once that process is gone, the others stop using the store (torch would
print a C++ stack for each call on the dead connection).

The heartbeat itself, its beats, its watch and its report, is :mod:`.heartbeat`'s; this
module holds this process's: started with each group it joins (:func:`watch_group`), found
by the strategy's hooks (:func:`current`), stopped with the group (:func:`stop_watching`).
"""

from __future__ import annotations

import atexit
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from lightning_par.launch.heartbeat import Heartbeat
from lightning_par.launch.rendezvous import dead_peer_timeout

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
    survive: Callable[[int, str], bool] | None = None,
) -> Heartbeat:
    """Start the heartbeat of the group this process just joined (ending the previous
    group's); peers silent for ``dead_after_s`` (default
    :func:`~lightning_par.launch.rendezvous.dead_peer_timeout`; at most the group's
    ``timeout``) end the job, but those ``survive`` says the job goes on without."""
    global _current
    if _current is not None:
        _current.stop()
    else:  # runs before the process group is destroyed at exit (atexit is last-in first-out)
        atexit.register(stop_watching)
    limit = dead_peer_timeout(timeout, dead_after_s)
    _current = Heartbeat(store, rank, watched, limit, name, _handler, survive).start()
    return _current


def current() -> Heartbeat | None:
    """The heartbeat of this process's group (``None`` when none runs)."""
    return _current


def store_gone() -> bool:
    """Whether the process that holds the store of this process's (last) group ended
    (``popen``'s rank 0): a call on that store would fail, printing torch's C++ stack first."""
    beat = _current or _last
    return beat is not None and beat.store_gone()


def stop_watching() -> None:
    """The group ends (``destroy_process_group``): stop its heartbeat."""
    global _current, _last
    if _current is not None:
        _current.stop()
        _current, _last = None, _current
