"""Who is still in the job: the agreements a fault-tolerant group makes in its store.

A synchronous group that goes on after losing a process needs two decisions every
survivor reaches alike, whatever the order in which they notice the loss:

* **the step's outcome** (:meth:`Membership.settle`): every rank steps its optimiser only
  once *every* member finished the step's gradient exchange. A rank that died after
  sending its last message, but before the others saw it arrive, would otherwise leave
  some survivors stepped and others not. Each member counts itself in; the last one in
  writes ``commit`` and a member that finds a peer dead (and not counted) proposes
  ``redo``; the store's ``compare_set`` keeps the first of the two, so all read one;
* **the next membership** (:meth:`Membership.regroup`): each survivor says it is alive;
  once every member has either said so or is known dead, the first survivor to write the
  list decides it, again by ``compare_set``.

This is the quorum torchft's Manager forms at each step (PyTorch's fault-tolerance
library: a lighthouse decides the replicas of the next step), reduced to one job's
key-value store, which here outlives any rank: it is served by a process of its own (the
launcher's :mod:`.store_host`) or by torchrun's agent. Members keep their first rank as
their name; a generation number keeps each membership's keys apart.

A member is *dead* when its process is gone on this machine (its pid absent or a zombie:
killed, ``os._exit``), or when a peer found it silent for ``dead_peer_timeout``
(:mod:`.liveness`) and recorded it with :meth:`Membership.declare_dead`.

A process can also **join** a running group (a lost rank's replacement: :mod:`.joining`).
It asks in the store; the last member to count itself into a step lists the processes that
asked (:meth:`Membership.joining`), so every member admits them at the same step boundary:
the next membership is then agreed as after a loss, with the joiners that are ready in it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from typing import Any

#: Keys of one job's fault-tolerance agreements (under the group's store prefix).
PREFIX = "lightning_par/ft"
#: How often a waiting member looks again: from the first to the last, doubling (seconds).
#: A store's ``wait`` with a timeout would do, but torch logs two warnings per timeout.
POLL_S = (0.0002, 0.01)

COMMIT, REDO = "commit", "redo"
#: A joiner's outcome once it is ready to meet the members (else: why it was turned away).
READY = "ready"


class Excluded(RuntimeError):
    """This process was left out of the next membership (found dead while alive: frozen
    longer than ``dead_peer_timeout``, then thawed)."""


class MembershipTimeout(RuntimeError):
    """A member neither answered nor could be found dead within the limit."""


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` of this machine has ended (absent, or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False


class Membership:
    """The members of one fault-tolerant group and their agreements (module docstring).

    Args:
        store: the group's key-value store (a ``TCPStore`` or a prefix of one).
        me: this process's first rank (its name for the whole job).
        members: every member's first rank, at the start.
        limit_s: how long a live member may take to answer before it counts as dead (a
            silent one is declared dead by the heartbeat sooner).
        kill: ends a process of this machine by pid (one found silent, or too slow to
            answer), so that it cannot speak for a member the others went on without.
    """

    def __init__(
        self, store: Any, me: int, members: list[int], limit_s: float,
        kill: Callable[[int], None] | None = None,
    ) -> None:  # fmt: skip
        self.store, self.me, self.limit_s, self.kill = store, me, limit_s, kill
        self.members = sorted(members)
        self.generation = 0
        self.lost: list[int] = []  # every member lost so far, in the order they were
        #: the first member whose place each joiner took (its shard of the data)
        self.places: dict[int, int] = {}
        self._host = socket.gethostname()
        self.store.set(f"{PREFIX}/proc/{me}", f"{self._host} {os.getpid()}")
        # the first members' count: joiners are named after them (the first call sets it)
        self.store.compare_set(f"{PREFIX}/world", "", str(len(members)))

    @property
    def rank(self) -> int:
        """This member's rank in the current membership."""
        return self.members.index(self.me)

    # ---- who is dead ---------------------------------------------------------------------
    def _process(self, member: int) -> tuple[str, int] | None:
        key = f"{PREFIX}/proc/{member}"
        if not self.store.check([key]):
            return None
        host, pid = self.store.get(key).decode().split()
        return host, int(pid)

    def is_dead(self, member: int) -> bool:
        """Whether ``member`` is known dead (module docstring)."""
        if self.store.check([f"{PREFIX}/dead/{member}"]):
            return True
        found = self._process(member)
        return found is not None and found[0] == self._host and process_gone(found[1])

    def declare_dead(self, member: int) -> bool:
        """Record ``member`` dead (found silent, or too slow to answer); on this machine,
        end it first (``kill``), so that every connection to it closes and a thawed
        process cannot speak for a member the others went on without. Whether this
        member was the first to declare it (the one to say so)."""
        found = self._process(member)
        if self.kill is not None and found is not None and found[0] == self._host:
            self.kill(found[1])
        me = str(self.me)
        return self.store.compare_set(f"{PREFIX}/dead/{member}", "", me).decode() == me

    # ---- the step's outcome --------------------------------------------------------------
    def settle(self, step: int) -> str:
        """After this member's gradient exchange of ``step`` succeeded: ``COMMIT`` if every
        member's did, else ``REDO`` (a member died first)."""
        key = f"{PREFIX}/{self.generation}/step/{step}"
        if self.store.add(f"{key}/in", 1) == len(self.members):
            joining = self.pending_joiners()  # (written first: read once COMMIT is)
            if joining:
                self.store.set(f"{key}/joining", json.dumps(joining))
            self.store.compare_set(f"{key}/outcome", "", COMMIT)
        return self._outcome(f"{key}/outcome")

    def joining(self, step: int) -> list[int]:
        """After ``COMMIT`` of ``step``: the processes every member admits at the next
        step's start (listed by the last member to count itself in)."""
        key = f"{PREFIX}/{self.generation}/step/{step}/joining"
        return json.loads(self.store.get(key).decode()) if self.store.check([key]) else []

    def pending_joiners(self) -> list[int]:
        """The processes that asked to join and were neither admitted nor turned away."""
        first = int(self.store.get(f"{PREFIX}/world").decode())
        names = range(first, first + self.store.add(f"{PREFIX}/join/names", 0))
        return [
            n for n in names
            if n not in self.members and self.store.check([f"{PREFIX}/join/{n}/asks"])
            and not self.store.check([f"{PREFIX}/join/{n}/outcome"])
        ]  # fmt: skip

    def _asks(self, joiner: int) -> dict[str, Any]:
        return json.loads(self.store.get(f"{PREFIX}/join/{joiner}/asks").decode())

    def asked_place(self, joiner: int) -> int | None:
        """The member whose place ``joiner`` asked to take (a restarted rank's), if any."""
        return self._asks(joiner).get("place")

    def asked_fit(self, joiner: int) -> int:
        """The number of the fault-tolerant fit of its script that ``joiner`` asked to join
        (the one it reached)."""
        return self._asks(joiner)["fit"]

    def turn_away(self, joiner: int, why: str) -> str:
        """Decide ``joiner``'s outcome as ``why`` unless it said it is ready first; the
        outcome stored (``READY`` or the reason it was turned away)."""
        key = f"{PREFIX}/join/{joiner}/outcome"
        return self.store.compare_set(key, "", why).decode()

    def _join_outcome(self, joiner: int, deadline: float) -> str | None:
        key = f"{PREFIX}/join/{joiner}/outcome"
        if self.store.check([key]):
            return self.store.get(key).decode()
        if self.is_dead(joiner):
            return self.turn_away(joiner, "its process ended before it was ready")
        if time.monotonic() > deadline:
            return self.turn_away(joiner, f"it was not ready within {self.limit_s:g} s")
        return None

    def _outcome(self, key: str) -> str:
        deadline, pause = time.monotonic() + self.limit_s, POLL_S[0]
        while not self.store.check([key]):
            if any(self.is_dead(m) for m in self.members if m != self.me):
                self.store.compare_set(key, "", REDO)
                break
            if time.monotonic() > deadline:
                raise MembershipTimeout(
                    f"rank {self.me}: the step's outcome was not decided within "
                    f"{self.limit_s:g} s and no peer is known dead"
                )
            time.sleep(pause)
            pause = min(2 * pause, POLL_S[1])
        return self.store.get(key).decode()

    # ---- the next membership -------------------------------------------------------------
    def regroup_begun(self) -> bool:
        """Whether a member began agreeing on the next membership (this one should too)."""
        return self.store.check([f"{PREFIX}/{self.generation + 1}/begun"])

    def regroup(self, places: dict[int, int] | None = None) -> list[int]:
        """Agree on the survivors (this one among them, else :class:`Excluded`); the
        members lost since the last membership are appended to :attr:`lost`. ``places``:
        the joiners admitted at this step boundary and the first member whose place each
        takes; those ready in time are members too (every member passes the same)."""
        generation = self.generation + 1
        key = f"{PREFIX}/{generation}"
        places = places or {}
        if not places:  # (a loss: wake every member; a join is known to all at once)
            self.store.set(f"{key}/begun", "1")
        self.store.set(f"{key}/alive/{self.me}", "1")
        deadline = time.monotonic() + self.limit_s
        while not self.store.check([f"{key}/members"]):
            alive = [m for m in self.members if self.store.check([f"{key}/alive/{m}"])]
            pending = [m for m in self.members if m not in alive and not self.is_dead(m)]
            if pending and time.monotonic() > deadline:
                for member in pending:  # alive but stuck: the others go on without it
                    self.declare_dead(member)
                pending = []
            joined = {n: self._join_outcome(n, deadline) for n in places}
            if not pending and None not in joined.values():
                ready = [n for n, outcome in joined.items() if outcome == READY]
                self.store.compare_set(f"{key}/members", "", json.dumps(alive + ready))
                break
            time.sleep(POLL_S[1])
        chosen = json.loads(self.store.get(f"{key}/members").decode())
        if self.me not in chosen:
            raise Excluded(
                f"rank {self.me} was found dead by its peers, who went on without it "
                f"(generation {generation})"
            )
        self.lost += [m for m in self.members if m not in chosen]
        self.places.update({n: place for n, place in places.items() if n in chosen})
        self.members, self.generation = chosen, generation
        return chosen
