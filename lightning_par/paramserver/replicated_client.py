"""The worker side of fault-tolerant parameter servers (``fault_tolerant=True``).

Three things change for a worker (the servers' side: :mod:`.shard_server`):

* each shard is talked to on its own tags, at whichever process holds it now, and the
  messages of the current request to each shard are kept until the next request
  (:mod:`.replicated_links`);
* every request (a step's header and pushes, a command, worker 0's initial slices or an
  optimiser state to load, which every worker sends) is answered by every shard (``DONE``
  where nothing comes back; a read: the state slices, to every worker, so that whichever
  worker leads once it comes has the whole state), so the worker waits on every server at
  every request;
* an answer from a lost server that fails moves its shard to the next server on the ring,
  which kept a copy of it, and the two agree where the request stands (:mod:`.takeover`):
  the answer comes again, or the kept request goes again.

A lost **worker** is survived too (:mod:`.lost_workers`): after each step's pushes every
shard says which lost workers' pushes it lacks (``MISSING``); the worker reads every
shard's answer before it writes any pulled weight, so the leader (the first live worker:
worker 0, or the first survivor once worker 0 is lost) still holds the weights the step
began with and pushes each missing worker's gradient in its place (:mod:`.missing_pushes`),
then trains those workers' batches beside its own (:attr:`ReplicatedClient.lost_workers`),
each one's gradient pushed in its slot.

Clipping by norm ties the servers together: none answers a step before it has every
shard's squared norm, so a worker waiting for a live server's answer would wait forever
for a lost server's shard to move. There a thread moves it: while the worker waits for
pulls, it looks every 0.1 s for a lost server in the store (:meth:`ReplicatedClient.watch`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from lightning_par.comm import CommError
from lightning_par.paramserver import protocol
from lightning_par.paramserver.faults import lost_server
from lightning_par.paramserver.messages import recv_object, send_object
from lightning_par.paramserver.missing_pushes import MissingPushes
from lightning_par.paramserver.protocol import Command, Kind, ShardTag, server_rank
from lightning_par.paramserver.replicated_links import ReplicatedLinks
from lightning_par.paramserver.replication import backup_of, server_processes
from lightning_par.paramserver.spec import ServerSpec
from lightning_par.paramserver.takeover import ask_to_resume
from lightning_par.paramserver.worker import ParameterClient

log = logging.getLogger("lightning_par")


class ReplicatedClient(ParameterClient):
    """A :class:`ParameterClient` of fault-tolerant servers (see the module docstring):
    shard ``s``'s copy lives in server process ``(s + 1) % N``
    (:func:`~.replication.backup_of`)."""

    links: ReplicatedLinks

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.request, self.command = 0, None  # request 0: the initial weights
        self.moved: set[int] = set()  # shards whose copy serves them now
        super().__init__(*args, **kwargs)
        self.closed = threading.Event()
        clip = kwargs.get("clip")
        if clip is not None and clip.algorithm == "norm":
            threading.Thread(target=self.watch, daemon=True, name="ps-lost-watch").start()

    @property
    def processes(self) -> int:
        return server_processes(len(self.servers), True)

    def make_links(self) -> ReplicatedLinks:
        links = ReplicatedLinks(self.comm, self.layout, self.params, list(self.servers),
                                num_workers=self.num_workers, recover=self._recover)  # fmt: skip
        #: the lost workers' pushes (worker 0 sends them; the strategy sets ``missing.fill``)
        self.missing = MissingPushes(self.comm, links, self.num_workers, self.rank,
                                     self._recover, self.name)  # fmt: skip
        return links

    def begin(self, spec: ServerSpec | None) -> None:
        held = {s for b in range(len(self.layout.buckets)) for s in self.layout.servers_of(b)}
        empty = sorted(set(range(self.layout.num_servers)) - held)
        if empty:
            raise ValueError(
                f"{self.name}: fault_tolerant=True needs every server to hold part of the "
                f"parameters, so that every worker hears from it each step; server(s) "
                f"{empty} hold none ({len(self.params)} trainable tensors over "
                f"{len(self.servers)} servers): lower num_servers or split_mb"
            )
        if spec is not None:
            for server in range(self.processes):  # the standby of a lone server too
                send_object(self.comm, spec, server_rank(self.num_workers, server))
            self.links.send_initial()
        self.links.post_pulls(Kind.INIT)

    # ---- requests ---------------------------------------------------------------------------
    def _new_request(self, command: Command) -> None:
        self.request, self.command = self.request + 1, command
        for kept in self.links.kept.values():
            kept.clear()

    def _open_step(self) -> list:
        self._new_request(Command.STEP)
        self.missing.expect(len(self.servers), self.step)
        message = self.header(Command.STEP).encode()
        return [(s, self.links.send(message, s, Kind.HEADER, self.step))
                for s in range(len(self.servers))]  # fmt: skip

    def _command(self, command: Command, obj: Any = None) -> None:
        """Send ``command`` (and ``obj``: from every worker, so that none waits on the
        leader, which a shard may have found lost before the workers) to every shard."""
        self.settle()
        self._new_request(command)
        messages = [(Kind.HEADER, self.header(command).encode())]
        if command == Command.SET_STATE:
            messages += [(Kind.OBJECT, m) for m in protocol.encode_object(obj)]
        shards = range(len(self.servers))
        self.links.wait_sends([(s, self.links.send(m, s, k)) for s in shards for k, m in messages])

    def _answer(self, s: int) -> Any:
        """Shard ``s``'s answer to the current command (a read: its state slices, to every
        worker, whichever leads by then), from whichever process holds the shard once it
        comes."""
        while True:
            holder = self.links.servers[s]
            try:
                if self.command == Command.GET_STATE:
                    return recv_object(self.comm, holder, protocol.decode_state,
                                       tag=ShardTag(Kind.OBJECT, s))  # fmt: skip
                buffer = protocol.count_buffer()
                self.comm.recv(buffer, holder, tag=ShardTag(Kind.DONE, s))
                return protocol.decode_count(buffer, Kind.DONE)
            except CommError as err:
                self._recover(s, err, holder)

    def gather_state(self) -> dict[str, Any]:
        self._command(Command.GET_STATE)
        answers = [self._answer(s) for s in range(len(self.servers))]
        return self.full_state(self.optimizer.state_dict(), answers)

    def load_state(self, state_dict: dict[str, Any]) -> None:
        self.settle()
        self.optimizer.load_state_dict({**state_dict, "state": {}})  # lr etc. for schedulers
        self._command(Command.SET_STATE, state_dict)
        for s in range(len(self.servers)):
            self._answer(s)

    def close(self) -> None:
        self._command(Command.STOP)
        for s in range(len(self.servers)):
            self._answer(s)
        self.remove_hooks()

    def remove_hooks(self) -> None:
        self.closed.set()
        super().remove_hooks()

    # ---- a lost worker (:mod:`.missing_pushes`) -----------------------------------------
    @property
    def lost_workers(self) -> list[int]:
        """The workers lost so far (worker 0 trains their batches)."""
        return self.missing.lost

    def _waiter(self, needed: list[int]):
        wait = super()._waiter(needed)

        def hook(module: Any, args: Any) -> None:
            if not self.missing.filling:  # (the lost workers' forward: the weights as they are)
                wait(module, args)

        return hook

    def _pushed(self, bucket: int) -> None:
        """Worker 0: the lost workers' pushes of ``bucket`` in their slots, after its own."""
        self.links.wait_sends(self.missing.push_kept(bucket, self.step))

    def wait_bucket(self, b: int) -> None:
        self.missing.read(self.step)  # (once a step: before any pulled weight is written)
        super().wait_bucket(b)

    # ---- a lost server --------------------------------------------------------------------
    def watch(self) -> None:
        """Clipping by norm: while the worker waits for pulls, move the shards of a server
        the store says is lost (see the module docstring)."""
        while not self.closed.wait(0.1):
            for s, rank in enumerate(self.links.servers):
                if self.links.waiting and lost_server(rank - self.num_workers, grace_s=0):
                    self._recover(s, None, rank)

    def _recover(self, s: int, error: CommError | None, rank: int) -> None:
        """An answer from shard ``s``'s holder ``rank`` failed (``error``; None: the store
        says it is lost): if that server is lost, the shard moves to the server that kept
        its copy, and the request is answered from there."""
        with self.links.lock:
            if self.links.servers[s] == rank:  # (else moved already, by the other thread)
                self._move(s, error)

    def _move(self, s: int, error: CommError | None) -> None:
        lost = self.links.servers[s] - self.num_workers
        how = lost_server(lost)
        if how is None:
            assert error is not None
            raise error
        backup = backup_of(s, self.processes)
        copy_lost = lost_server(backup, grace_s=0)
        if s in self.moved or copy_lost:
            why = (f"parameter server {backup}, which kept the copy, {copy_lost}" if copy_lost
                   else "it held that shard after the shard's own server was lost")  # fmt: skip
            raise CommError(
                f"worker {self.rank}: parameter server {lost} (rank {lost + self.num_workers}) "
                f"{how}, and no live process holds a copy of shard {s} ({why}): the job "
                "cannot go on (fault_tolerant survives one lost server per shard)"
            ) from error
        holder = server_rank(self.num_workers, backup)
        log.debug("worker %d: parameter server %d %s", self.rank, lost, how)
        self.links.servers[s] = holder
        self.moved.add(s)
        try:
            done = ask_to_resume(self.comm, holder, s, self.request)
            if self.command in (None, Command.STEP):
                self.links.repost(s)
            if done == self.request - 1:
                self.links.resend(s)
            if self.command == Command.STEP:  # its answer ends with a MISSING: read now
                self.missing.read_again(s, holder)
            log.debug("worker %d: parameter server %d lost; shard %d answered by rank %d from "
                      "request %d (%s)", self.rank, lost, s, holder, self.request,
                      "sent again" if done < self.request else "answered again")  # fmt: skip
        except CommError as err:
            raise CommError(
                f"worker {self.rank}: parameter server {lost} (rank {lost + self.num_workers}) "
                f"{how}, and parameter server {backup} (rank {holder}), which kept the copy "
                f"of its shard, could not take over: {err}"
            ) from err
