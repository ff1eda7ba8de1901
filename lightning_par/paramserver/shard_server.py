"""A fault-tolerant server process (``fault_tolerant=True``): its own shard, answered with a
backup, and the copy of the shard before it on the ring, taken over if that server dies.

:class:`ShardServer` answers one shard's requests as :func:`~.server.serve` does, with
three differences:

* every message of a shard travels on that shard's tags, so a process that answers for two
  shards (its own and a lost server's) runs one :class:`ShardServer` per shard, each in a
  thread, and neither takes the other's messages;
* every request gets an answer from every shard (``DONE`` where it returns no data), so
  every worker notices a lost server at the request it waits on, and that request's number
  tells the new holder what the worker misses (:mod:`.takeover`);
* each record goes to the shard's backup, and is acknowledged, before any worker hears
  anything (:mod:`.replication`);
* a lost worker is let go: its pushes come from the first live worker instead, worker 0
  unless that is the one lost (:mod:`.lost_workers`).

:func:`serve_replicated` is what a server process runs: a thread answering for its shard,
a thread keeping the copy of its predecessor's shard, which becomes that shard's server when
the predecessor is lost (:func:`keep_copy`).
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any

from lightning_par.comm import CommError, Communicator
from lightning_par.paramserver import protocol
from lightning_par.paramserver.faults import fault_of
from lightning_par.paramserver.lost_workers import LostWorkers
from lightning_par.paramserver.messages import (
    exchange_norms_in_store,
    recv_object,
    send_object,
)
from lightning_par.paramserver.protocol import IDLE_TIMEOUT, Command, Header, Kind, server_rank
from lightning_par.paramserver.replication import (
    Backup,
    Progress,
    Replica,
    backup_of,
    copy_held_by,
)
from lightning_par.paramserver.server import ShardOptimizer
from lightning_par.paramserver.spec import ServerSpec
from lightning_par.paramserver.takeover import resume_workers

Strike = Callable[[int], None] | None


class ShardServer:
    """Shard ``shard.server``'s requests, answered by this process (see the module
    docstring); ``backup``: where its records go (None: no copy any more)."""

    def __init__(
        self, comm: Communicator, shard: ShardOptimizer, backup: Backup | None = None,
        strike: Strike = None,
    ) -> None:  # fmt: skip
        self.comm, self.shard, self.backup, self.strike = comm, shard, backup, strike
        self.workers = LostWorkers(shard.spec.num_workers)

    def serve(self, progress: Progress | None = None) -> None:
        """Answer every request until ``STOP``; after a takeover, from the request after
        ``progress.done`` (the buckets it applied already are not applied again)."""
        if progress is not None and progress.last == Command.STOP:
            return  # the primary answered its last request
        applied = progress.applied if progress is not None else frozenset()
        count = progress.done + 1 if progress is not None else 0
        if count == 0:
            self.shard.share_initial(self.comm, self.backup.initial if self.backup else None)
            count, applied = 1, frozenset()
        tag = self.shard.tag(Kind.HEADER)
        spec = self.shard.spec
        while True:
            header = self.workers.headers(self.comm, spec.num_hyper, IDLE_TIMEOUT, tag)
            if not self.serve_request(header, count, applied):
                return
            count, applied = count + 1, frozenset()

    def serve_request(self, header: Header, count: int, applied: frozenset[int]) -> bool:
        """Request ``count`` (``header``), recorded, applied and answered; False: ``STOP``."""
        command, shard = header.command, self.shard
        if command == Command.STEP:
            if self.strike is not None:
                self.strike(header.step)
            shard.set_hyper(list(header.hyper))
            self._record(header)
            update = self.backup.update if self.backup is not None else None
            self.workers.step(self.comm, shard, header.step, update, applied)
            return True
        if command == Command.SET_STATE:
            size, data = self.workers.object_bytes(self.comm, shard.tag(Kind.OBJECT))
            self._record(header, (size, data))
            shard.load_full(protocol.decode_state(data))
        elif command in (Command.GET_STATE, Command.STOP):
            self._record(header)
        else:
            raise protocol.ProtocolError(
                f"parameter server {shard.server}: command {command.name} is for the "
                "asynchronous server"
            )
        for w in self.workers.live:
            self.answer(w, count, command)
        return command != Command.STOP

    def _record(self, header: Header, payload: tuple = ()) -> None:
        if self.backup is not None:
            self.backup.record(header, payload)

    def answer(self, worker: int, count: int, command: Command | None) -> None:
        """Send ``worker`` the answer to request ``count`` of ``command`` (``None``: the
        initial weights) as this shard stands: every bucket's slices (a step's: then that
        nothing is missing), the state (a read: to every worker, so that whichever leads
        when it comes writes the checkpoint), or ``DONE``; a worker lost meanwhile is let
        go."""
        shard, comm, workers = self.shard, self.comm, self.workers
        if command in (None, Command.STEP):
            kind = Kind.INIT if command is None else Kind.PULL
            for b in shard.active:
                workers.send(comm, shard.slices(b), worker, shard.tag(kind), chunk=b)
            if command == Command.STEP:
                missing = protocol.encode_missing([], shard.spec.num_workers)
                workers.send(comm, missing, worker, shard.tag(Kind.MISSING))
        elif command == Command.GET_STATE:
            try:
                send_object(comm, shard.state_slices(), worker, tag=shard.tag(Kind.OBJECT))
            except CommError as err:
                workers.lose(worker, err)
        else:
            workers.send(comm, protocol.encode_count(count), worker, shard.tag(Kind.DONE))


class Threads:
    """The threads of one server process: :meth:`wait` returns when all ended, or raises the
    first error of any (the process then ends)."""

    def __init__(self) -> None:
        self._ended: queue.Queue[BaseException | None] = queue.Queue()
        self._running = 0

    def spawn(self, target: Callable[[], None], name: str) -> None:
        self._running += 1
        threading.Thread(target=self._run, args=(target,), daemon=True, name=name).start()

    def _run(self, target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as err:
            self._ended.put(err)
            return
        self._ended.put(None)

    def wait(self) -> None:
        while self._running:
            error = self._ended.get()
            self._running -= 1
            if error is not None:
                raise error


def serve_replicated(
    comm: Communicator, server: int, processes: int, store: Any, timeout: timedelta
) -> None:
    """Run server process ``server`` of ``processes`` (group rank ``W + server``) until every
    shard it answers for has stopped; ``store``: the group's (clipping by norm)."""
    spec: ServerSpec | None = recv_object(comm, 0, protocol.decode_spec, IDLE_TIMEOUT)
    if spec is None:  # nothing to train (validate/test/predict)
        return
    shards, threads, strike = spec.plan.num_servers, Threads(), fault_of(server)

    def shard_of(index: int) -> ShardOptimizer:
        shard = ShardOptimizer(spec, index, tagged=True)
        shard.norms = partial(exchange_norms_in_store, store, shards, index, timeout=timeout)
        return shard

    if server < shards:
        to = backup_of(server, processes)
        lost = partial(_standby_lost, server, to) if to >= shards else (lambda how: None)
        backup = Backup(comm, shard_of(server), server_rank(spec.num_workers, to), lost)
        threads.spawn(ShardServer(comm, backup.shard, backup, strike).serve, f"ps-shard-{server}")
    copied = copy_held_by(server, shards, processes)
    if copied is not None:  # the standby of a lone server strikes at its copy's steps
        keep = partial(keep_copy, comm, shard_of(copied), server, threads,
                       strike if server >= shards else None)  # fmt: skip
        threads.spawn(keep, f"ps-copy-{copied}")
    threads.wait()


def keep_copy(
    comm: Communicator, copy: ShardOptimizer, server: int, threads: Threads, strike: Strike
) -> None:
    """Keep the copy of shard ``copy.server`` until its primary stops; if it is lost,
    answer for the shard from the copy on (its workers redirected by :mod:`.takeover`)."""
    workers = copy.spec.num_workers
    progress = Replica(comm, copy, server_rank(workers, copy.server), strike).follow()
    if progress is None:
        return
    holder = ShardServer(comm, copy)
    threads.spawn(partial(resume_workers, comm, copy, progress, holder.answer,
                          partial(_took_over, copy.server, server, workers, progress),
                          holder.workers), f"ps-resume-{copy.server}")  # fmt: skip
    holder.serve(progress)


def _took_over(lost: int, server: int, workers: int, progress: Progress) -> None:
    print(
        f"lightning_par: parameter server {lost} (rank {server_rank(workers, lost)}) "
        f"{progress.how}; parameter server {server} (rank {server_rank(workers, server)}) "
        f"took over its shard from the copy it kept (weights and optimiser state after "
        f"{progress.steps} steps) and the job went on",
        file=sys.stderr, flush=True,
    )  # fmt: skip


def _standby_lost(server: int, standby: int, how: str) -> None:
    print(
        f"lightning_par: parameter server {standby}, the standby holding the copy of "
        f"parameter server {server}'s shard, {how}; parameter server {server} goes on "
        "without a copy",
        file=sys.stderr, flush=True,
    )  # fmt: skip


__all__ = ["ShardServer", "Threads", "keep_copy", "serve_replicated"]
