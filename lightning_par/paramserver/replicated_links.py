"""The pushes and pulls of a worker whose shards may move (``fault_tolerant=True``).

:class:`ReplicatedLinks` is :class:`~lightning_par.paramserver.links.ServerLinks` for
fault-tolerant servers (its client: :mod:`.replicated_client`):

* each shard is talked to on its own tags (:class:`~.protocol.ShardTag`), at whichever
  process holds it now (:attr:`ReplicatedLinks.servers` is indexed by shard);
* the messages of the current request to each shard are kept until the next request, so
  that a shard's new holder can be sent them again (:meth:`ReplicatedLinks.resend`);
* a message to a server that fails is let go if that server is lost (the worker that
  started it says so in the group's store: :func:`~.faults.lost_server`); a pull from it
  that fails calls the client's ``recover``, which moves the shard to the server that
  kept its copy, and the pulls are posted again there (:meth:`ReplicatedLinks.repost`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from lightning_par.comm import CommError, Handle
from lightning_par.paramserver.faults import lost_server
from lightning_par.paramserver.links import ServerLinks
from lightning_par.paramserver.protocol import Kind, ShardTag


class _Failed:
    """A message whose posting failed (its peer's connection closed): waiting raises."""

    def __init__(self, error: CommError, peer: int) -> None:
        self.error, self.peer = error, peer

    def wait(self, timeout: Any = None) -> torch.Tensor:
        raise self.error


class ReplicatedLinks(ServerLinks):
    """:class:`ServerLinks` to shards that may move: ``recover(shard, error)`` is called when
    an answer from a shard's holder fails (and re-posts that shard's pulls)."""

    def __init__(
        self, *args: Any, num_workers: int, recover: Callable[[int, CommError, int], None]
    ) -> None:
        super().__init__(*args)
        self.num_workers, self.recover = num_workers, recover
        self.lock = threading.Lock()  # pending and servers, against the watch (clip by norm)
        self.waiting = False  # inside wait_bucket
        #: the messages of the current request, per shard, in the order they went
        self.kept: dict[int, list[tuple[Kind, torch.Tensor]]] = {
            s: [] for s in range(self.plan.num_servers)
        }
        self.kind = Kind.INIT  # what the pulls of the current request are

    def tag(self, kind: Kind, server: int) -> ShardTag:
        return ShardTag(kind, server)

    def send(self, message: torch.Tensor, s: int, kind: Kind, step: int | None = None,
             chunk: int | None = None) -> Handle | _Failed:  # fmt: skip
        self.kept[s].append((kind, message))
        try:
            return super().send(message, s, kind, step, chunk)
        except CommError as err:
            return _Failed(err, self.servers[s])

    def expect(self, b: int, s: int, kind: Kind, step: int | None = None) -> Handle | _Failed:
        self.kind = kind
        try:
            return super().expect(b, s, kind, step)
        except CommError as err:
            return _Failed(err, self.servers[s])

    def wait_sends(self, sends: list[tuple[int, Handle | _Failed]]) -> None:
        """Wait for messages to the shards' holders; one that failed because its server is
        lost is let go (its answer will fail too, and the shard move then)."""
        for s, handle in sends:
            try:
                handle.wait()
            except CommError:
                if lost_server(self.servers[s] - self.num_workers) is None:
                    raise

    def wait_bucket(self, b: int) -> None:
        self.waiting = True
        try:
            while True:
                with self.lock:
                    if not self.pending.get(b):
                        self.pending.pop(b, None)
                        return
                    s, handle = self.pending[b][0]
                try:
                    flat = handle.wait()
                except CommError as err:
                    self.recover(s, err, handle.peer)  # shard s moved: its pulls posted again
                    continue
                with self.lock:
                    self.pending[b].remove((s, handle))
                self.write(b, s, flat)
        finally:
            self.waiting = False

    def repost(self, s: int) -> None:
        """Shard ``s`` moved: post the receive of its slices of every bucket from its new
        holder, which sends them all (the same numbers again where one came already)."""
        for b in range(len(self.plan.buckets)):
            if s in self.plan.servers_of(b):
                others = [(q, h) for q, h in self.pending.get(b, []) if q != s]
                self.pending[b] = [*others, (s, self.expect(b, s, self.kind))]

    def resend(self, s: int) -> None:
        """Send shard ``s``'s new holder this worker's kept messages of the current request."""
        kept, self.kept[s] = self.kept[s], []
        self.wait_sends([(s, self.send(message, s, kind)) for kind, message in kept])
