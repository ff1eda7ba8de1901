"""Which shards of a fault-tolerant ``fit``'s data each member trains.

A ``fit``'s data is sharded over the members it began with (:attr:`FitShards.fit_members`),
and each step averages the gradients of every one of those shards. After a loss the
survivors train the lost members' shards beside their own, handed round robin
(:meth:`FitShards.stands_in_for`, :attr:`FitShards.loss_scale`); a joiner takes back the
shard of the lost member whose place it took (:mod:`.rejoin`).
"""

from __future__ import annotations

from typing import Any

from lightning_par.launch.membership import Membership


class FitShards:
    """The shard accounting of :class:`~.fault_tolerance.FaultTolerance` (its base), from
    its membership and the members the ``fit`` began with."""

    membership: Membership | None
    #: the members when this ``fit`` began: their shards make each step's batch
    fit_members: list[int]

    @property
    def lost(self) -> list[int]:
        """The members of this ``fit`` lost since it began (their first ranks) whose place
        no joiner took: their shards are trained by stand-ins."""
        if self.membership is None:
            return []
        places = self.membership.places
        held = {places.get(m, m) for m in self.membership.members}
        return [m for m in self.fit_members if m not in held]

    def stands_in_for(self) -> list[int]:
        """The shards (sampler ranks of this ``fit``) of the lost members that this member
        trains beside its own: the lost handed round robin over the survivors."""
        if self.membership is None:
            return []
        survivors, me = self.membership.members, self.membership.me
        return [
            self.fit_members.index(m)
            for i, m in enumerate(self.lost)
            if survivors[i % len(survivors)] == me
        ]  # fmt: skip

    @property
    def loss_scale(self) -> float:
        """What each survivor's summed loss is multiplied by so that the survivors' average
        of gradients is the average over every shard of this ``fit``."""
        if self.membership is None:
            return 1.0
        return len(self.membership.members) / len(self.fit_members)

    def sampler_kwargs(self, first: dict[str, Any], training: bool = False) -> dict[str, Any]:
        """How a data loader built now shards its data: over the members there are
        (``first``: Lightning's, over every rank, while none was lost); a joiner's training
        loader reads the shard of the member whose place it took."""
        membership = self.membership
        if membership is None:
            return first
        if training and membership.me not in self.fit_members:
            place = self.fit_members.index(membership.places[membership.me])
            return {**first, "num_replicas": len(self.fit_members), "rank": place}
        if not membership.lost:
            return first
        return {**first, "num_replicas": len(membership.members), "rank": membership.rank}
