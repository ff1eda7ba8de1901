"""What one worker sends to and takes from each server: a pure function of sizes and servers.

A gradient bucket ``b`` (parameters in the order backward fills them) becomes, for each
server ``s`` holding a piece of it, one push and one pull whose layout is
``slices[b][s]``: the ``(position in bucket b, piece)`` pairs of that server's pieces, in
bucket order. The synchronous and the asynchronous client share this plan; the bytes move
in :mod:`~lightning_par.paramserver.links`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lightning_par.paramserver.plan import Piece, ShardPlan, plan_shards

Slices = tuple[tuple[int, Piece], ...]  # (position in the bucket, piece) of one message


@dataclass(frozen=True)
class ClientPlan:
    """Per bucket and server, the slices one push and one pull carry."""

    shards: ShardPlan
    buckets: tuple[tuple[int, ...], ...]  # parameter indices per bucket, in push order
    slices: tuple[tuple[Slices, ...], ...]  # slices[b][s]

    @property
    def num_servers(self) -> int:
        return self.shards.num_servers

    def numel(self, bucket: int, server: int) -> int:
        """Elements of parameters in the message between this worker and ``server``."""
        return sum(piece.numel for _, piece in self.slices[bucket][server])

    def servers_of(self, bucket: int) -> list[int]:
        """The servers holding a piece of ``bucket`` (each gets one push, sends one pull)."""
        return [s for s, sl in enumerate(self.slices[bucket]) if sl]

    def buckets_of(self, params: Iterable[int]) -> list[int]:
        """The buckets holding any of ``params`` (what a layer waits for before forward)."""
        wanted = set(params)
        return [b for b, members in enumerate(self.buckets) if wanted & set(members)]


def plan_client(
    numels: Sequence[int],
    element_sizes: Sequence[int],
    buckets: Sequence[Sequence[int]],
    num_servers: int,
    split_bytes: int = 1 << 20,
) -> ClientPlan:
    """Shard parameters of ``numels`` elements over ``num_servers`` servers
    (:func:`~lightning_par.paramserver.plan.plan_shards`) and lay out each bucket's messages."""
    shards = plan_shards(numels, element_sizes, num_servers, split_bytes)
    members = tuple(tuple(b) for b in buckets)
    if sorted(i for b in members for i in b) != list(range(len(numels))):
        raise ValueError("buckets must hold every parameter index exactly once")
    slices = tuple(
        tuple(
            tuple((b.index(piece.param), piece) for piece in shards.message(b, s))
            for s in range(num_servers)
        )
        for b in members
    )
    return ClientPlan(shards, members, slices)
