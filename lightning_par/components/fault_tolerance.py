"""The fault-tolerance component: a synchronous group that goes on without a lost process.

What a data-parallel strategy with ``fault_tolerant=True`` holds (the design of torchft,
PyTorch's fault-tolerance library, github.com/pytorch/torchft: a quorum per step, survivors
going on with fewer replicas; here reduced to one job's store,
:mod:`lightning_par.launch.membership`):

* every step ends with :meth:`FaultTolerance.settle`: the optimiser steps only once every
  member finished the step's gradient exchange; otherwise :class:`StepLost` is raised;
* :meth:`FaultTolerance.retrying` wraps Lightning's optimiser closure: when the step is
  lost (a peer's connection closed under a collective, or :class:`StepLost`), the old
  process group is destroyed, which fails every survivor still blocked on it at once,
  the survivors agree on who is left, meet in a new default group (ranks renumbered in
  their first order) and run the closure again: the same step, on the same batches;
* the batches of the lost members are not dropped: :meth:`FaultTolerance.stands_in_for`
  hands each lost member's shard to one survivor (round robin over the survivors in
  their order), which trains it beside its own, so that each step still averages the
  gradients of every shard of the first world (:attr:`FaultTolerance.loss_scale`;
  :mod:`.fit_shards`);
* a lost rank's replacement starts with :meth:`FaultTolerance.start_as_joiner` and meets
  the members with :meth:`FaultTolerance.enter_group` (:mod:`.rejoin`).

A silent peer (frozen, its machine gone) is found by the heartbeat
(:mod:`lightning_par.launch.liveness`) after ``dead_peer_timeout`` and, on this machine,
ended, so that every connection to it closes and the survivors' collectives fail at once.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_par.comm import CommError
from lightning_par.components.fit_shards import FitShards
from lightning_par.components.group_break import break_default_group, end_process
from lightning_par.components.process_group import destroy_process_group
from lightning_par.launch import liveness
from lightning_par.launch.joining import Admission, count_fit, fit_begins, fit_ends
from lightning_par.launch.membership import PREFIX, REDO, Membership


class StepLost(RuntimeError):
    """A member died before every member finished the step's gradient exchange."""


#: How often a rank looks whether another began regrouping (seconds).
_WATCH_S = 0.05


class FaultTolerance(FitShards):
    """Keeps one data-parallel group going after lost members (module docstring)."""

    def __init__(self, recovery: str = "the step is run again on the same batches") -> None:
        #: how the line saying who was lost ends: what the survivors do next
        self.recovery = recovery
        self.membership: Membership | None = None
        #: the members when this ``fit`` began: their shards make each step's batch
        self.fit_members: list[int] = []
        #: this ``fit``'s number in the script (:func:`~lightning_par.launch.joining.count_fit`)
        self.fit_number = 0
        self._store: Any = None
        self._init: dict[str, Any] = {}
        self._lock = threading.Lock()  # the default group is swapped under it
        self._regrouping = False
        self._stop = threading.Event()
        self._dead_after_s = 0.0
        #: whether training runs (the watcher asks the store only then)
        self.watching = False
        #: the processes that join at the next step's start (:mod:`.rejoin`)
        self.joining: list[int] = []
        #: ``(what, wall time)``: when a step was found lost and when the group re-formed
        #: (``python -m lightning_par.bench faults`` reads them)
        self.events: list[tuple[str, float]] = []

    def __getstate__(self) -> dict[str, Any]:
        # what a spawned or forkserver rank gets: no lock, thread or store of this process's
        state = dict(self.__dict__)
        for name in ("_lock", "_stop", "_store", "membership"):
            state.pop(name)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._store = self.membership = None

    def start(
        self, store: Any, rank: int, world_size: int, backend: str, timeout: timedelta,
        limit_s: float, dead_after_s: float, device: Any = None,
    ) -> None:  # fmt: skip
        """This rank joined the default group of ``world_size`` ranks in ``store``;
        ``limit_s``: how long a live member may take to answer; ``dead_after_s``: the
        heartbeat's limit for a silent one; ``device``: the rank's (a CUDA one is passed to
        each new group, as to the first)."""
        self._hold(store, backend, timeout, dead_after_s, device)
        self.fit_members = list(range(world_size))
        self.membership = Membership(store, rank, list(range(world_size)), limit_s, end_process)
        heartbeat = liveness.current()
        if heartbeat is not None:
            heartbeat.hand_silent_peers_to(self._silent)
        self._start_watching()

    def start_as_joiner(
        self, store: Any, name: int, admission: Admission, backend: str, timeout: timedelta,
        limit_s: float, dead_after_s: float, device: Any = None,
    ) -> None:  # fmt: skip
        """This process was admitted as ``name`` to the running group in ``store``
        (:mod:`lightning_par.launch.joining`; the rest as for :meth:`start`). Until it
        enters the group (:meth:`enter_group`) it computes alone, in a process group of its
        own, so that what Lightning runs while it sets up involves no member."""
        self._hold(store, backend, timeout, dead_after_s, device)
        self.fit_members, self.fit_number = list(admission.fit_members), admission.fit
        membership = Membership(store, name, admission.members, limit_s, end_process)
        membership.lost, membership.places = list(admission.lost), dict(admission.places)
        membership.generation = admission.generation - 1  # (entered at its first step)
        self.membership = membership
        alone = dist.PrefixStore(f"{PREFIX}/join/{name}/alone", store)
        dist.init_process_group(rank=0, world_size=1, store=alone, **self._init)
        atexit.register(destroy_process_group)  # (before the interpreter's shutdown, as members)
        self._start_watching()  # (idle until it enters: not watching)

    def enter_group(self, name: Callable[[int], str]) -> None:
        """The joiner, once the members agreed on the membership with it in: leave its own
        group, meet them in theirs, and be watched by them (and watch them) as any member
        (``name``: how reports name a rank)."""
        assert self.membership is not None
        dist.destroy_process_group()
        self.meet()
        me = self.membership.me
        others = [m for m in self.membership.members if m != me]
        heartbeat = liveness.watch_group(
            self._store, me, others, self._init["timeout"], name, self._dead_after_s
        )
        heartbeat.hand_silent_peers_to(self._silent)
        self.watching = True

    def _hold(
        self, store: Any, backend: str, timeout: timedelta, dead_after_s: float, device: Any
    ) -> None:
        """Keep how the next groups meet: in ``store``, with these settings."""
        self._store, self._dead_after_s = store, dead_after_s
        self._init = {"backend": backend, "timeout": timeout}
        if device is not None and getattr(device, "type", "cpu") != "cpu":
            self._init["device_id"] = device

    def _start_watching(self) -> None:
        threading.Thread(target=self._watch, daemon=True, name="lp-regroup-watch").start()
        atexit.register(self._stop.set)

    def _watch(self) -> None:
        """A member began regrouping: break this rank's group too, so that a message this
        rank waits for from a live peer (which will never send it now) fails at once.
        Breaking one's own group closes its connections, but a rank waiting on a third
        one's message only learns of it from its own group."""
        broken = -1
        while not self._stop.wait(_WATCH_S):
            membership = self.membership
            if not self.watching:
                continue  # between fits: no step to lose, and the store may be closing
            if liveness.store_gone():
                return  # popen's rank 0 ended with the job's store: nothing to watch
            try:
                begun = membership is not None and membership.regroup_begun()
            except Exception:
                return  # the store is gone: the job ends
            with self._lock:
                generation = membership.generation if membership is not None else -1
                if begun and not self._regrouping and broken != generation:
                    broken = generation
                    if dist.is_initialized():
                        break_default_group()

    def _silent(self, rank: int, report: str) -> bool:
        assert self.membership is not None
        if rank not in self.membership.members:
            return True
        if self.membership.is_dead(rank):  # its process ended: the launcher says so
            self.membership.declare_dead(rank)
        elif self.membership.declare_dead(rank):  # (the first to find it says so)
            print(f"lightning_par: {report}; it is ended and the others go on without it",
                  file=sys.stderr, flush=True)  # fmt: skip
        return True

    # ---- the step ------------------------------------------------------------------------
    def begin_fit(self) -> None:
        """A ``fit`` begins: its data is sharded over the members there are now, and
        replacements that reached the same fit of the script (its number: every member
        counts alike) may join until it ends (:meth:`end_fit`)."""
        self.fit_number = count_fit()
        if self.membership is not None:
            self.fit_members = list(self.membership.members)
            self.membership.places.clear()  # (every member holds its own shard again)
            fit_begins(self.membership.store, self.fit_number)

    def end_fit(self) -> None:
        """The ``fit`` ended: a replacement asking to join now is turned away."""
        if self.membership is not None and not liveness.store_gone():
            try:
                fit_ends(self.membership.store)
            except Exception:
                pass  # the store is gone: the job ends

    def settle(self, step: int) -> None:
        """After this rank's gradient exchange: return once every member finished it, else
        raise :class:`StepLost`."""
        if self.membership is None:
            return
        if self.membership.settle(step) == REDO:
            raise StepLost(f"a member was lost before step {step}'s gradients were averaged")
        self.joining = self.membership.joining(step)

    def retrying(self, closure: Callable[[], Any], regrouped: Callable[[], None]) -> Callable:
        """``closure`` run again after each loss of members (``regrouped()`` rebuilds what
        held the old group) until a step completes."""

        def run(*args: Any, **kwargs: Any) -> Any:
            while True:
                try:
                    return closure(*args, **kwargs)
                except RuntimeError as error:  # (gloo's own errors are RuntimeErrors)
                    if not self._a_member_was_lost(error):
                        raise
                    self.events.append(("lost", time.time()))
                    self.regroup(error)
                    regrouped()
                    self.events.append(("regrouped", time.time()))

        return run

    def _a_member_was_lost(self, error: RuntimeError) -> bool:
        """Whether ``error`` comes of a lost member: ours say so; any other (a message that
        could not even be posted, a collective of Lightning's) counts once a member is
        known dead or regrouping began, which a peer's heartbeat makes known within
        ``dead_peer_timeout`` (a user's own error is raised after that wait)."""
        if isinstance(error, (StepLost, CommError)):
            return True
        membership = self.membership
        if membership is None:
            return False
        deadline = time.monotonic() + self._dead_after_s
        while True:
            others = [m for m in membership.members if m != membership.me]
            if membership.regroup_begun() or any(membership.is_dead(m) for m in others):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(_WATCH_S)

    # ---- the next membership -------------------------------------------------------------
    def regroup(self, error: BaseException | None, places: dict[int, int] | None = None) -> None:
        """Destroy the default group (its survivors' blocked messages fail at once), agree
        on the survivors (and the joiners of ``places`` that are ready: :mod:`.rejoin`) and
        meet them in a new default group; re-raise ``error`` if no member was lost (it was
        not a loss)."""
        assert self.membership is not None
        before = list(self.membership.members)
        with self._lock:
            self._regrouping = True
            if dist.is_initialized():
                if places is None:  # (at a join every member is at the step's start)
                    break_default_group()
                dist.destroy_process_group()
        try:
            members = self.membership.regroup(places)
        finally:
            self._regrouping = False
        if members == before and error is not None:
            raise error
        heartbeat = liveness.current()
        for rank in before:
            if rank not in members and heartbeat is not None:
                heartbeat.forget(rank)
        self.meet()
        gone = ", ".join(str(r) for r in before if r not in members)
        if gone and self.membership.rank == 0:  # one line for the job
            print(
                f"lightning_par: rank(s) {gone} lost; {len(members)} of {len(before)} ranks "
                f"go on (ranks {members}), {self.recovery}",
                file=sys.stderr, flush=True,
            )  # fmt: skip

    def meet(self) -> None:
        """Meet the members of the current membership in a new default group."""
        assert self.membership is not None
        generation = self.membership.generation
        group_store = dist.PrefixStore(f"{PREFIX}/{generation}/group", self._store)
        dist.init_process_group(
            rank=self.membership.rank, world_size=len(self.membership.members),
            store=group_store, **self._init,
        )  # fmt: skip
