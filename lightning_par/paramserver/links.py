"""The object that moves one worker's bytes to and from the servers, as a
:class:`~lightning_par.paramserver.client_plan.ClientPlan` lays them out.

Push and pull are written once here for the synchronous and the asynchronous client: a
push posts, per server holding a piece of the bucket, the gradient slices (``PUSH``) and
at once the receive of the updated slices (``PULL``); :meth:`ServerLinks.wait_bucket`
writes the received slices into the parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_par.comm import CommError, Communicator, Handle
from lightning_par.comm.buckets import Bucket
from lightning_par.comm.p2p import Tag
from lightning_par.paramserver import protocol
from lightning_par.paramserver.client_plan import ClientPlan
from lightning_par.paramserver.faults import explain
from lightning_par.paramserver.protocol import Kind


class ServerLinks:
    """One worker's pushes and pulls.

    Args:
        comm: a Communicator over the group of workers and servers.
        plan: the messages per bucket and server.
        params: the trainable parameters, indexed as in ``plan``.
        servers: the group rank of each server.
    """

    def __init__(
        self, comm: Communicator, plan: ClientPlan, params: list[nn.Parameter], servers: list[int]
    ) -> None:
        self.comm, self.plan, self.params, self.servers = comm, plan, params, servers
        self.rank = comm.rank
        dtype, device = params[0].dtype, params[0].device
        self.pull = [
            [torch.empty(plan.numel(b, s), dtype=dtype, device=device)
             for s in range(plan.num_servers)]
            for b in range(len(plan.buckets))
        ]  # fmt: skip
        self.pending: dict[int, list[tuple[int, Handle]]] = {}  # bucket -> (server, pull)

    def tag(self, kind: Kind, server: int) -> Tag:
        """The tag of a ``kind`` message to or from ``server`` (its kind's)."""
        return kind

    def send(self, message: torch.Tensor, s: int, kind: Kind, step: int | None = None,
             chunk: int | None = None) -> Handle:  # fmt: skip
        """Post ``message`` to server ``s``."""
        return self.comm.isend(message, self.servers[s], step=step, chunk=chunk,
                               tag=self.tag(kind, s))  # fmt: skip

    def expect(self, b: int, s: int, kind: Kind, step: int | None = None) -> Handle:
        """Post the receive of bucket ``b``'s slices from server ``s``."""
        return self.comm.irecv(self.pull[b][s], self.servers[s], step=step, chunk=b,
                               tag=self.tag(kind, s))  # fmt: skip

    def send_initial(self) -> None:
        """Worker 0: every server's initial slices (``INIT``)."""
        for b, per_server in enumerate(self.plan.slices):
            for s in self.plan.servers_of(b):
                flat = protocol.encode_slices([self.params[pc.param].flatten()[pc.start : pc.stop]
                                               for _, pc in per_server[s]])  # fmt: skip
                self.wait_sends([(s, self.send(flat.clone(), s, Kind.INIT, chunk=b))])

    def post_pulls(self, kind: Kind = Kind.PULL) -> None:
        """Post the receive of every bucket's slices (``INIT`` at the start; ``PULL`` for the
        servers' current weights)."""
        for b in range(len(self.plan.buckets)):
            self.pending[b] = [(s, self.expect(b, s, kind)) for s in self.plan.servers_of(b)]

    def push(self, bucket: Bucket, step: int) -> list[tuple[int, Handle]]:
        """Post ``bucket``'s gradient slices to their servers and the receives of the updated
        slices; returns the sends (server, handle), not yet waited for."""
        b = bucket.index
        sends, pulls = [], []
        for s in self.plan.servers_of(b):
            sl = self.plan.slices[b][s]
            grads = [bucket.views[i].flatten()[pc.start : pc.stop] for i, pc in sl]
            message = protocol.encode_push(grads, [bucket.flags[i] for i, _ in sl])
            sends.append((s, self.send(message, s, Kind.PUSH, step, b)))
            pulls.append((s, self.expect(b, s, Kind.PULL, step)))
        self.pending[b] = pulls
        return sends

    def wait_sends(self, sends: list[tuple[int, Handle]]) -> None:
        """Wait for pushes (and headers) posted to servers, naming the one that failed."""
        for s, handle in sends:
            try:
                handle.wait()
            except CommError as err:
                raise CommError(explain(
                    f"worker {self.rank}: a message to parameter server {s} "
                    f"(rank {self.servers[s]}) failed: {err}"
                )) from err  # fmt: skip

    def wait_bucket(self, b: int) -> None:
        """Wait for bucket ``b``'s updated slices and write them into the parameters."""
        pulls = self.pending.pop(b, None)
        if not pulls:
            return
        for s, handle in pulls:
            try:
                flat = handle.wait()
            except CommError as err:
                raise CommError(explain(
                    f"worker {self.rank}: no update from parameter server {s} "
                    f"(rank {self.servers[s]}): {err}"
                )) from err  # fmt: skip
            self.write(b, s, flat)

    def write(self, b: int, s: int, flat: torch.Tensor) -> None:
        """Write bucket ``b``'s slices received from server ``s`` into the parameters."""
        pieces = [pc for _, pc in self.plan.slices[b][s]]
        received = protocol.decode_slices(flat, [pc.numel for pc in pieces])
        with torch.no_grad():
            for pc, values in zip(pieces, received):
                self.params[pc.param].data.view(-1)[pc.start : pc.stop].copy_(values)

    def settle(self) -> None:
        """Wait for every outstanding pull."""
        for b in list(self.pending):
            self.wait_bucket(b)
