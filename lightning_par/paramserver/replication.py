"""Primary-backup replication of a server's shard: nothing is lost when a server dies.

Li et al. ("Scaling Distributed Machine Learning with the Parameter Server", OSDI 2014,
section 4.3) keep each server's key range on the next server of a ring as well, and
replicate *after aggregation*: the primary sends its replica the aggregated update, not
every worker's push, and a push is acknowledged only once the replica holds it (without
this a server's shard dies with its process: ps-lite issue #68). Here, with
``fault_tolerant=True``:

* **the ring**: server ``s``'s shard (its slices of the weights and their optimiser state)
  is copied in the process of server ``(s + 1) % N`` (:func:`backup_of`), ``N`` the server
  processes: ``S``, or 2 with one server, whose copy a standby process (server 1) holds;
* **a record per request** the primary answers, numbered as the workers number their
  requests (0: the initial weights, then one per header): the initial slices; a step's
  header (its hyperparameters), then per bucket the averaged, clipped gradient the primary
  applied (``UPDATE``), which the copy applies with the same optimiser (the same arithmetic
  on the same numbers gives the same bits); a checkpoint's state it loaded; a read or a stop
  (nothing changes, but the count moves on);
* **acknowledged before answered**: the backup acknowledges each update (each record without
  one, ``ACK``) and only then does the primary send the workers anything. So whatever any
  worker received from a primary, its copy holds. A backup that is lost is forgotten and
  its primary goes on without one.

:meth:`Replica.follow` applies the records until its primary is lost, then returns how far
its copy got (:class:`Progress`); :mod:`~lightning_par.paramserver.takeover` goes on from
there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lightning_par.comm import CommError, Communicator
from lightning_par.paramserver import protocol
from lightning_par.paramserver.faults import lost_server
from lightning_par.paramserver.messages import recv_object_bytes
from lightning_par.paramserver.protocol import IDLE_TIMEOUT, NONE, Command, Header, Kind
from lightning_par.paramserver.server import ShardOptimizer


def server_processes(num_shards: int, fault_tolerant: bool) -> int:
    """Server processes for ``num_shards`` shards: one more (a standby) for a lone server
    whose copy must live in another process."""
    return num_shards + 1 if fault_tolerant and num_shards == 1 else num_shards


def backup_of(shard: int, processes: int) -> int:
    """The server process holding the copy of ``shard``: the next one on the ring."""
    return (shard + 1) % processes


def copy_held_by(server: int, num_shards: int, processes: int) -> int | None:
    """The shard whose copy server process ``server`` holds (its predecessor's), if any."""
    shard = (server - 1) % processes
    return shard if shard < num_shards and shard != server else None


@dataclass(frozen=True)
class Progress:
    """How far a copy got when its primary was lost.

    Attributes:
        done: the last record it holds whole (0: the initial weights; -1: not even those).
        last: that record's command (``None``: the initial weights).
        applied: the buckets of the next record, a step, it applied already.
        steps: the steps whose every update it holds.
        how: how the primary's process ended ("was killed by SIGKILL").
    """

    done: int
    last: Command | None
    applied: frozenset[int]
    steps: int
    how: str


class Backup:
    """A primary's link to the copy of its shard (in group rank ``rank``)."""

    def __init__(
        self, comm: Communicator, shard: ShardOptimizer, rank: int,
        on_lost: Callable[[str], None] = lambda how: None,
    ) -> None:  # fmt: skip
        self.comm, self.shard, self.rank, self.on_lost = comm, shard, rank, on_lost
        self.record_count = 0  # the record being sent (0: the initial weights)

    def _tag(self, kind: Kind) -> protocol.ShardTag:
        return protocol.ShardTag(kind, self.shard.server)

    def initial(self) -> None:
        """Record 0: the initial slices (taken from worker 0, not yet sent anyone)."""
        slices = [(Kind.INIT, self.shard.flat[b]) for b in self.shard.active]
        self._guarded(lambda: self._send(slices, NONE))

    def record(self, header: Header, payload: Sequence[torch.Tensor] = ()) -> None:
        """The next record: ``header`` (a worker's) and, for ``SET_STATE``, the object's two
        messages; acknowledged now unless a step's updates follow."""
        self.record_count += 1
        messages = [(Kind.HEADER, header.encode()), *((Kind.OBJECT, m) for m in payload)]
        updates = header.command == Command.STEP and self.shard.active
        self._guarded(lambda: self._send(messages, None if updates else NONE))

    def update(self, bucket: int, grad: torch.Tensor, used: torch.Tensor) -> None:
        """The update applied to ``bucket`` in the current step, acknowledged."""
        message = protocol.encode_update(grad, used)
        self._guarded(lambda: self._send([(Kind.UPDATE, message)], bucket))

    def _send(self, messages: list[tuple[Kind, torch.Tensor]], ack: int | None) -> None:
        assert self.rank is not None
        for kind, message in messages:
            self.comm.send(message, self.rank, tag=self._tag(kind))
        if ack is None:
            return
        buffer = protocol.ack_buffer()
        self.comm.recv(buffer, self.rank, tag=self._tag(Kind.ACK))
        if protocol.decode_ack(buffer) != (self.record_count, ack):
            raise protocol.ProtocolError(
                f"parameter server {self.shard.server}: its backup acknowledged "
                f"{protocol.decode_ack(buffer)}, not (record, bucket) {(self.record_count, ack)}"
            )

    def _guarded(self, send: Callable[[], None]) -> None:
        """``send`` to the backup, unless it is lost: then forgotten (``on_lost``)."""
        if self.rank is None:
            return
        try:
            send()
        except CommError:
            how = lost_server(self.rank - self.shard.spec.num_workers)
            if how is None:
                raise
            self.rank = None
            self.on_lost(how)


class Replica:
    """The copy of shard ``shard.server``, kept up to date by its primary (group rank
    ``primary``); ``strike(step)`` as each step's record begins (a planned fault)."""

    def __init__(
        self, comm: Communicator, shard: ShardOptimizer, primary: int,
        strike: Callable[[int], None] | None = None,
    ) -> None:  # fmt: skip
        self.comm, self.shard, self.primary, self.strike = comm, shard, primary, strike
        self.done, self.last, self.steps = -1, None, 0
        self.applied: set[int] = set()

    def _tag(self, kind: Kind) -> protocol.ShardTag:
        return protocol.ShardTag(kind, self.shard.server)

    def follow(self) -> Progress | None:
        """Apply every record until the primary stops (``None``) or is lost (how far the copy
        got); a failure that is no loss is raised."""
        try:
            for b in self.shard.active:
                self.comm.recv(self.shard.flat[b], self.primary, chunk=b, tag=self._tag(Kind.INIT))
            self._ack(NONE)
            self.done = 0
            while self._apply_record():
                self.done, self.applied = self.done + 1, set()
            return None
        except CommError:
            how = lost_server(self.primary - self.shard.spec.num_workers)
            if how is None:
                raise
            return Progress(self.done, self.last, frozenset(self.applied), self.steps, how)

    def _apply_record(self) -> bool:
        """The next record, applied and acknowledged; False after a stop."""
        spec, shard = self.shard.spec, self.shard
        buffer = Header.buffer(spec.num_hyper)
        self.comm.irecv(buffer, self.primary, tag=self._tag(Kind.HEADER)).wait(IDLE_TIMEOUT)
        header = Header.decode(buffer, spec.num_hyper, f"parameter server {shard.server}")
        if header.command == Command.STEP:
            if self.strike is not None:
                self.strike(header.step)
            shard.set_hyper(list(header.hyper))
            for b in shard.active:
                message = shard.push_buffer(b)
                self.comm.recv(message, self.primary, chunk=b, tag=self._tag(Kind.UPDATE))
                n, slices = shard.flat[b].numel(), len(shard.layout[b])
                shard.apply(b, *protocol.decode_update(message, n, slices))
                self.applied.add(b)
                self._ack(b)
            self.steps += 1
        elif header.command == Command.SET_STATE:
            _, data = recv_object_bytes(self.comm, self.primary, tag=self._tag(Kind.OBJECT))
            shard.load_full(protocol.decode_state(data))
        elif header.command not in (Command.GET_STATE, Command.STOP):
            raise protocol.ProtocolError(f"a record of command {header.command.name}")
        if header.command != Command.STEP or not shard.active:
            self._ack(NONE)
        self.last = header.command
        return header.command != Command.STOP

    def _ack(self, bucket: int) -> None:
        message = protocol.encode_ack(self.done + 1, bucket)
        self.comm.send(message, self.primary, tag=self._tag(Kind.ACK))
