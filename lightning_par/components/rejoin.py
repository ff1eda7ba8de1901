"""A lost rank's replacement joining a fault-tolerant group: the members' side and its own.

The protocol is :mod:`lightning_par.launch.joining`; this is what each side of a
:class:`~.fault_tolerance.FaultTolerance` does with it:

* the members (:func:`admit`), at the start of the step after the one whose settlement
  listed joiners: one that asked to join another fit of the script (as the last one ended)
  is turned away; each other joiner is given the place of a lost member (the one it asked
  for, the rank it was started as, if that place is free; else the first free one), the
  leading member offers it the training state, and every member waits at that step's
  start while the joiners restore it and agree on the next membership with those ready in
  it. A joiner takes back its place's shard of the data from the survivor that stood in
  for it;
* the joiner (:func:`join`, then :func:`enter`): it asks, waits for its admission and the
  state, computes alone in a process group of its own while Lightning restores the state
  and sets up, and at its first training step meets the members in their new group
  (:class:`FaultTolerance`'s :meth:`~.FaultTolerance.start_as_joiner` and
  :meth:`~.FaultTolerance.enter_group` hold its side of the group).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from lightning_par.components.fault_tolerance import FaultTolerance
from lightning_par.launch import joining, liveness
from lightning_par.launch.joining import Admission


@dataclass
class Offer:
    """What the leading member sends each joiner: the training state (bytes of
    ``torch.save``), the epoch and batch of the step it joins at, and the strategy's
    extras (:class:`~lightning_par.launch.joining.Admission`)."""

    state: bytes
    epoch: int
    batch: int
    extras: dict[str, Any]


def places_for(tolerance: FaultTolerance, joiners: list[int]) -> dict[int, int | None]:
    """The lost member whose place (shard) each joiner takes; None: no place is free. Every
    member computes the same from the same store."""
    membership = tolerance.membership
    assert membership is not None
    free, places = list(tolerance.lost), {}
    for joiner in joiners:
        asked = membership.asked_place(joiner)
        place = asked if asked in free else (free[0] if free else None)
        if place is not None:
            free.remove(place)
        places[joiner] = place
    return places


def admit(tolerance: FaultTolerance, offer: Callable[[], Offer], step: int) -> list[int]:
    """At the start of ``step``, every member: admit the joiners the last step listed (the
    leader sends them ``offer()``); the joiners now members."""
    joiners, tolerance.joining = tolerance.joining, []
    membership = tolerance.membership
    if not joiners or membership is None:
        return []
    running, same_fit = tolerance.fit_number, []
    for joiner in joiners:  # (it asked before the last fit ended: that fit's model and data)
        reached = membership.asked_fit(joiner)
        if reached == running:
            same_fit.append(joiner)
        else:
            membership.turn_away(joiner, joining.other_fit(running, reached))
    places: dict[int, int] = {}
    for joiner, place in places_for(tolerance, same_fit).items():
        if place is None:
            membership.turn_away(joiner, "no lost rank's place was free for it")
        else:
            places[joiner] = place
    if not places:
        return []
    started = time.monotonic()
    if membership.rank == 0:
        sent = offer()
        for joiner in places:
            admission = Admission(
                membership.generation + 1, [*membership.members, *places],
                tolerance.fit_members, membership.lost, {**membership.places, **places},
                sent.epoch, sent.batch, sent.extras, tolerance.fit_number,
            )  # fmt: skip
            joining.offer(membership.store, joiner, admission, sent.state)
    tolerance.regroup(None, places)
    admitted = [j for j in places if j in membership.members]
    heartbeat = liveness.current()
    for joiner in admitted:
        if heartbeat is not None:
            heartbeat.watch(joiner)
    if admitted:
        tolerance.events.append(("joined", time.time()))
    if admitted and membership.rank == 0:
        taken = ", ".join(f"rank {places[j]}'s replacement joined as rank {j}" for j in admitted)
        print(
            f"lightning_par: {taken} at step {step} (the members waited "
            f"{time.monotonic() - started:.1f} s); {len(membership.members)} ranks go on "
            f"(ranks {membership.members})", file=sys.stderr, flush=True,
        )  # fmt: skip
    return admitted


def join(
    tolerance: FaultTolerance, store: Any, place: int | None, backend: str,
    timeout: timedelta, limit_s: float, dead_after_s: float, device: Any = None,
) -> tuple[Admission, bytes]:  # fmt: skip
    """This process joins the running group in ``store`` in ``place``'s place, at the fit
    of the script it reached (its first: a replacement runs the script from its start): its
    admission and the training state. Until :func:`enter` it computes alone (a process
    group of its own), so that what Lightning runs while it sets up involves no member."""
    name = joining.ask(store, place, joining.count_fit())
    admission, state = joining.await_admission(store, name, limit_s)
    tolerance.start_as_joiner(
        store, name, admission, backend, timeout, limit_s, dead_after_s, device
    )
    return admission, state


def enter(tolerance: FaultTolerance, admission: Admission, name: Callable[[int], str]) -> None:
    """The joiner, at its first training step: meet the members in their new group and be
    watched by them (and watch them) as any member."""
    membership = tolerance.membership
    assert membership is not None
    joining.enter(membership, admission.generation)
    tolerance.enter_group(name)
