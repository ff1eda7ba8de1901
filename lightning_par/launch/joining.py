"""A process that joins a running fault-tolerant group: a lost rank's replacement.

The survivors of a fault-tolerant run go on with fewer ranks (:mod:`.membership`). A
process started later in a lost rank's place (by its keeper when torchrun was given
``--max-restarts``: :mod:`.keeper`) joins them at a step boundary and receives the current
training state from a healthy peer instead of reading a checkpoint from disk, as torchft's
replicas recover from a live peer (PyTorch's fault-tolerance library,
github.com/pytorch/torchft). At its first ``fit`` the joiner

1. asks in the job's store (:func:`ask`), named after the first members (the first joiner
   of a 3-rank job is member 3), saying whose place it would take (the rank it was started
   as);
2. waits (:func:`await_admission`): the last member to count itself into a step lists it
   (:meth:`~.membership.Membership.joining`), and at the next step's start the leading
   member writes the training state (:func:`offer`: a checkpoint as Lightning dumps it,
   written by ``torch.save`` and read with ``weights_only=True``, so that no object of
   another process is unpickled) and what the joiner needs to take its place;
3. restores that state and, at its first training step, says it is ready
   (:func:`enter`): the members, waiting at that step's start, agree on the membership with
   it in, and all meet in a new process group.

Fits are numbered (:func:`count_fit`): every member runs the same script, so all number a
fault-tolerant ``fit`` alike, and the members write the number of the one they run in the
store (:func:`fit_begins`). A joiner runs the script from its start, so the fit it reaches
is its first; it joins only a fit of the same number (another one's model and data are not
its own). It is turned away (:class:`NotAdmitted`, with the reason) if no fit is running,
if the members run another fit, if the fit ends before the members admit it, if it is not
ready within the limit, or if no lost member's place is free for it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from lightning_par.launch.membership import POLL_S, PREFIX, READY, Excluded, Membership

#: Set in a process that joins a running group instead of starting one (a keeper sets it
#: in the replacement it starts).
JOIN_ENV = "LIGHTNING_PAR_JOIN"
#: The number of the fault-tolerant ``fit`` the members run (:func:`count_fit`), "0" between
#: fits, absent before the first (joiners are admitted while one runs). Never deleted: a
#: store's ``get`` of an absent key waits for it (:func:`running_fit` reads it).
FITTING_KEY = f"{PREFIX}/fitting"

_fits_begun = 0


def count_fit() -> int:
    """Count a fault-tolerant ``fit`` this process begins, as a member or joining it: its
    number in the script (1 for the first)."""
    global _fits_begun
    _fits_begun += 1
    return _fits_begun


def fit_begins(store: Any, fit: int) -> None:
    """The members began fit number ``fit``: a joiner that reached the same may join it."""
    store.set(FITTING_KEY, str(fit))


def fit_ends(store: Any) -> None:
    """The members' fit ended: a joiner asking now is turned away."""
    store.set(FITTING_KEY, "0")


def running_fit(store: Any) -> int:
    """The number of the fault-tolerant fit the members run (0: none)."""
    return int(store.get(FITTING_KEY).decode()) if store.check([FITTING_KEY]) else 0


def other_fit(running: int, reached: int) -> str:
    """Why a joiner that reached fit ``reached`` of its script may not join fit ``running``."""
    return (
        f"the members run fault-tolerant fit {running} of the script, this process reached "
        f"fit {reached} (a replacement runs the script from its start and can join only the "
        "fit it reaches: the first)"
    )


class NotAdmitted(RuntimeError):
    """The members did not admit this process (the message says why)."""


def _key(joiner: int, what: str) -> str:
    return f"{PREFIX}/join/{joiner}/{what}"


@dataclass
class Admission:
    """What the leading member sends a joiner (besides the training state)."""

    #: the generation of the membership the joiner enters
    generation: int
    #: the members after the join, as the leader expects them (decided in :func:`enter`)
    members: list[int]
    #: the members when the running ``fit`` began: their shards make each step's batch
    fit_members: list[int]
    #: the members lost so far
    lost: list[int]
    #: the first member whose place each joiner took (this one's included)
    places: dict[int, int]
    #: the epoch and batch the joiner's first step trains
    epoch: int
    batch: int
    #: what the strategy adds (the ring's message sizes, the loggers' versions)
    extras: dict[str, Any]
    #: the number of the fit it joins (:func:`count_fit`)
    fit: int = 1

    def to_json(self) -> str:
        return json.dumps({**self.__dict__, "places": list(self.places.items())})

    @classmethod
    def from_json(cls, text: str) -> Admission:
        fields = json.loads(text)
        return cls(**{**fields, "places": {int(n): p for n, p in fields["places"]}})


def ask(store: Any, place: int | None, fit: int = 1) -> int:
    """Ask to join the group in ``store`` at fit number ``fit`` of the script (the one this
    process reached), taking ``place``'s shard (a first member's); this process's name in
    the group."""
    running = running_fit(store)
    if running == 0:
        raise NotAdmitted("no fault-tolerant fit of the job is running")
    if running != fit:
        raise NotAdmitted(other_fit(running, fit))
    first = int(store.get(f"{PREFIX}/world").decode())
    name = first + store.add(f"{PREFIX}/join/names", 1) - 1
    store.set(f"{PREFIX}/proc/{name}", f"{socket.gethostname()} {os.getpid()}")
    store.set(_key(name, "asks"), json.dumps({"place": place, "fit": fit}))
    return name


def await_admission(store: Any, name: int, limit_s: float) -> tuple[Admission, bytes]:
    """Wait until the members admit joiner ``name``: what the leader sent, and the training
    state (bytes of ``torch.save``); :class:`NotAdmitted` if they turn it away, if the fit
    ends first (or the whole job: its store is gone), or after ``limit_s``."""
    try:
        return _await_admission(store, name, limit_s)
    except (RuntimeError, OSError) as err:  # (torch's DistNetworkError: a RuntimeError)
        if isinstance(err, NotAdmitted):
            raise
        raise NotAdmitted(f"the job's store is gone: the job ended ({err})") from err


def _await_admission(store: Any, name: int, limit_s: float) -> tuple[Admission, bytes]:
    deadline, pause = time.monotonic() + limit_s, POLL_S[0]
    fit = json.loads(store.get(_key(name, "asks")).decode())["fit"]
    while not store.check([_key(name, "admission")]):
        if store.check([_key(name, "outcome")]):
            raise NotAdmitted(store.get(_key(name, "outcome")).decode())
        if running_fit(store) != fit:  # (ended; or ended and the next one began)
            why = "the fit ended before the members admitted it"
            raise NotAdmitted(store.compare_set(_key(name, "outcome"), "", why).decode())
        if time.monotonic() > deadline:
            why = f"the members did not admit it within {limit_s:g} s"
            raise NotAdmitted(store.compare_set(_key(name, "outcome"), "", why).decode())
        time.sleep(pause)
        pause = min(2 * pause, POLL_S[1])
    admission = Admission.from_json(store.get(_key(name, "admission")).decode())
    return admission, store.get(_key(name, "state"))


def offer(store: Any, name: int, admission: Admission, state: bytes) -> None:
    """The leading member: send joiner ``name`` the training state and its admission."""
    store.set(_key(name, "state"), state)
    store.set(_key(name, "admission"), admission.to_json())  # (last: the joiner waits for it)


def withdraw(store: Any, name: int, why: str) -> None:
    """The joiner gives up (its state could not be restored): the members go on without it."""
    store.compare_set(_key(name, "outcome"), "", why)


def enter(membership: Membership, generation: int) -> list[int]:
    """The joiner is ready: wait for the members' agreement on membership ``generation``
    and take its place in it (:class:`NotAdmitted` if they went on without it)."""
    store, name = membership.store, membership.me
    outcome = membership.turn_away(name, READY)  # (READY unless they turned it away first)
    if outcome != READY:
        raise NotAdmitted(outcome)
    key = f"{PREFIX}/{generation}/members"
    deadline = time.monotonic() + membership.limit_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise NotAdmitted(f"the members did not meet it within {membership.limit_s:g} s")
        time.sleep(POLL_S[1])
    chosen = json.loads(store.get(key).decode())
    if name not in chosen:
        raise Excluded(f"rank {name} was ready too late: the members went on without it")
    membership.members, membership.generation = chosen, generation
    return chosen
