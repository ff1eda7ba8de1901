"""Asynchronous SGD on the parameter servers (Downpour style), with bounded staleness.

The synchronous server (:func:`~lightning_par.paramserver.server.synchronous_step`) waits for
every worker's push before it updates. Here a server takes the workers' messages in the
order they arrive (one reader thread per worker) and, for each push, at once runs the user's
optimiser on that one worker's gradient (:meth:`ShardOptimizer.apply`) and sends that
worker the new weights; other workers are never waited for (Dean et al., "Large Scale
Distributed Deep Networks", NIPS 2012: Downpour SGD).

**Staleness.** The server counts its updates (``version``). A worker's gradient was computed
on the weights it last pulled; the number of updates applied since that pull is the
update's *staleness*, sent back to the worker with the weights (``info``: staleness, the
worker's lead over the slowest worker, the version) and recorded there.

**Stale synchronous parallel** (Ho et al., "More Effective Distributed ML via a Stale
Synchronous Parallel Parameter Server", NIPS 2013). A worker's *clock* is the number of its
pushes applied. With ``staleness=s`` the server holds back a worker's weights while its clock
is more than ``s`` ahead of the slowest running worker's, so no worker runs more than ``s``
steps ahead; a worker that stopped no longer counts. ``s=0`` is the synchronous limit: no
one may be ahead, so the server keeps each round's pushes until all have arrived and
applies their mean once, exactly :func:`synchronous_step` (the same sum in worker order).
``s=None`` never holds anyone back.

**Lost workers.** A receive from one worker fails as soon as that worker's process dies
(its connection closes); the servers then drop it, print which one, count the slowest
clock over the others only, and server 0 hands its untrained batches to the others
(:class:`~lightning_par.paramserver.work.WorkQueue`). Losing worker 0 ends the job. A worker
that stops responding without dying (frozen) is not dropped: its process would hold the job
at its end, so the servers' heartbeat names it and the job ends
(:mod:`lightning_par.launch.liveness`).

**Remedies** (:mod:`~lightning_par.paramserver.remedies`): before the optimiser applies a
push, the server may scale it by its staleness, compensate its delay (DC-ASGD: it keeps the
weights it last sent each worker) or run the optimiser at a lower momentum.

Workers push their whole gradient in one message after backward (one gradient bucket): a
server reads one worker's message at a time, and a push spread over a backward would hold
the server, and every other worker, for that backward.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable

import torch

from lightning_par.comm import CommError, Communicator, wait_all
from lightning_par.paramserver import protocol
from lightning_par.paramserver.messages import recv_header, recv_object, send_object
from lightning_par.paramserver.protocol import (
    IDLE_TIMEOUT,
    Command,
    Header,
    Info,
    Kind,
    ProtocolError,
)
from lightning_par.paramserver.remedies import Remedies, StaleUpdate, cap_momentum
from lightning_par.paramserver.server import ShardOptimizer, apply_averaged
from lightning_par.paramserver.spec import ServerSpec
from lightning_par.paramserver.work import WorkQueue

#: Commands a worker may die during, before taking the answer: it is dropped, not fatal.
_ANSWERED = (Command.STEP, Command.NEXT, Command.PULL)


def check_staleness(staleness: object) -> int | None:
    """``staleness`` if it is ``None`` or an int >= 0; otherwise a clear error."""
    if staleness is None:
        return None
    if isinstance(staleness, bool) or not isinstance(staleness, int):
        raise TypeError(
            f"staleness must be a whole number of steps >= 0 or None (fully asynchronous), "
            f"got {staleness!r}"
        )
    if staleness < 0:
        raise ValueError(
            f"staleness must be >= 0 (0: synchronous; s: at most s steps ahead of the "
            f"slowest worker) or None, got {staleness}"
        )
    return staleness


class AsyncServer:
    """One server's asynchronous (or stale synchronous) update loop."""

    def __init__(
        self, comm: Communicator, shard: ShardOptimizer, staleness: int | None,
        remedies: Remedies | None = None, forget: Callable[[int, str], None] | None = None,
    ) -> None:  # fmt: skip
        self.comm, self.shard, self.staleness = comm, shard, staleness
        self.forget = forget or (lambda w, report: None)
        workers = shard.spec.num_workers
        self.remedies = remedies or Remedies()
        self.stale = StaleUpdate(self.remedies, shard.flat, workers)
        for w in range(workers):  # share_initial sent every worker the initial weights
            self.stale.sent(w, shard.active)
        self.running = set(range(workers))
        self.stopped: list[int] = []
        self.clock = [0] * workers  # pushes applied per worker
        self.pulled = [0] * workers  # the version each worker last received
        self.version = 0
        self.waiting: dict[int, int] = {}  # worker -> staleness of its last update, unanswered
        self.held: dict[int, tuple[list[torch.Tensor], list[float]]] = {}  # s=0: this round
        self.history: list[tuple[int, int, int]] = []  # (worker, staleness, lead at reply)
        self.work = WorkQueue()  # used on server 0 when the workers share batches
        self.dropped: list[int] = []  # workers lost during the run

    def run(self) -> None:
        # One reader thread per worker takes that worker's whole messages (header, then a
        # push or a state): a receive from one worker fails at once when its process dies,
        # where a receive from any rank would not notice.
        self.inbox: queue.Queue = queue.Queue()
        for w in range(self.shard.spec.num_workers):
            threading.Thread(target=self._read, args=(w,), daemon=True).start()
        while self.running:
            w, header, payload = self.inbox.get()
            if header is None:
                if isinstance(payload, ProtocolError):
                    raise payload  # a bug, not a lost worker
                self._drop(w, payload)
                continue
            try:
                self._handle(w, header, payload)
            except (CommError, RuntimeError) as err:
                if header.command not in _ANSWERED or isinstance(err, ProtocolError):
                    raise
                self._drop(w, err)  # it died before taking our answer

    def _read(self, w: int) -> None:
        shard = self.shard
        try:
            while True:
                header = recv_header(self.comm, w, shard.spec.num_hyper, IDLE_TIMEOUT)
                payload = None
                if header.command == Command.STEP:
                    payload = [shard.push_buffer(b) for b in shard.active]
                    wait_all([self.comm.irecv(buf, w, step=header.step, chunk=b, tag=Kind.PUSH)
                              for b, buf in zip(shard.active, payload)])  # fmt: skip
                elif header.command == Command.SET_STATE:
                    if w != 0:  # only worker 0 resumes the servers' state
                        raise ProtocolError(
                            f"worker {w} (rank {w}) sent SET_STATE: only worker 0 may"
                        )
                    payload = recv_object(self.comm, w, protocol.decode_state)
                self.inbox.put((w, header, payload))
                if header.command == Command.STOP:
                    return
        except (CommError, RuntimeError) as err:
            self.inbox.put((w, None, err))

    def _handle(self, w: int, header: Header, payload) -> None:
        command = header.command
        if command == Command.STEP:
            self.work.trained(w, *header.trained)
            self._push(w, payload, list(header.hyper))
        elif command == Command.NEXT:  # step: the epoch; count: its number of batches
            reply = protocol.encode_work(*self.work.take(w, header.step, header.count))
            self.comm.send(reply, w, tag=Kind.WORK)
        elif command == Command.GET_STATE:
            send_object(self.comm, self.shard.state_slices(), w)
        elif command == Command.SET_STATE:
            self.shard.load_full(payload)
        elif command == Command.PULL:
            self._send_weights([w])
        elif command == Command.STOP:
            self.running.discard(w)
            self.stopped.append(w)
            self._release()
            self._finish()

    def _finish(self) -> None:
        if not self.running:  # the final weights, to every worker that stopped
            self._send_weights(self.stopped)

    def _drop(self, w: int, err: BaseException) -> None:
        """Worker ``w`` is gone: go on without it; its untrained batches go to the others."""
        if w not in self.running:
            return
        if w == 0:
            raise CommError(f"worker 0 (rank 0: logging, checkpoints) was lost: {err}")
        self.running.discard(w)
        # dead, not frozen: no heartbeat names it; the report, should the job end after all
        how = "its process was killed or ended without raising an error"
        self.forget(w, f"worker {w} (rank {w}) was lost: its connection to parameter server "
                       f"{self.shard.server} closed ({how})")  # fmt: skip
        self.waiting.pop(w, None)
        self.held.pop(w, None)
        lost = self.work.drop(w)
        print(
            f"lightning_par: asynchronous parameter server {self.shard.server} "
            f"(rank {self.comm.rank}) dropped worker {w} (rank {w}): {str(err).splitlines()[0]}"
            + (f"; its batches {lost} (epoch, batch) go to the other workers" if lost else ""),
            file=sys.stderr, flush=True,
        )  # fmt: skip
        self.dropped.append(w)
        self._release()
        self._finish()

    def _push(self, w: int, bufs: list[torch.Tensor], hyper: list[float]) -> None:
        shard = self.shard
        if self.staleness == 0:
            self.held[w] = (bufs, hyper)
            self._release()
            return
        shard.set_hyper(hyper)  # this worker's schedule
        if self.remedies.momentum is not None and shard.optimizer is not None:
            cap_momentum(shard.optimizer.param_groups, self.remedies.momentum, self.remedies.strict)
        staleness = self.version - self.pulled[w]
        for b, buf in zip(shard.active, bufs):  # clipped by the worker, if at all
            grad, used = shard.decode_push(b, buf)
            shard.apply(b, self.stale.gradient(w, b, grad, staleness), used)
        self.waiting[w] = staleness
        self.version += 1
        self.clock[w] += 1
        self._release()

    def _release(self) -> None:
        if self.staleness == 0:
            self._apply_round()
            return
        for w in sorted(self.waiting):
            if w not in self.waiting:  # answered while another worker was dropped
                continue
            lead = self.clock[w] - min((self.clock[v] for v in self.running), default=0)
            if self.staleness is None or lead <= self.staleness:
                self._reply(w, self.waiting.pop(w), lead)

    def _apply_round(self) -> None:
        """``s=0``: once every running worker has pushed, apply their mean (as synchronous)."""
        if not self.held or not self.running <= set(self.held):
            return
        order = sorted(self.held)
        shard = self.shard
        shard.set_hyper(self.held[order[0]][1])
        grads = {}
        for i, b in enumerate(shard.active):
            total = self.held[order[0]][0][i].clone()
            for w in order[1:]:
                total += self.held[w][0][i]  # worker order: the same sum as synchronous_step
            grad, used = shard.decode_push(b, total)
            grads[b] = (grad.div_(len(order)), used)
        # clipped as synchronous_step does (by norm: over every server's shard of the mean);
        # every server applies the same rounds in the same order
        apply_averaged(self.comm, shard, grads, self.version)
        self.version += 1
        self.held.clear()
        for w in order:
            self.clock[w] += 1
            self._reply(w, 0, 0)

    def _send_weights(self, workers: list[int]) -> None:
        wait_all([self.comm.isend(self.shard.slices(b), w, chunk=b, tag=Kind.PULL)
                  for w in workers for b in self.shard.active])  # fmt: skip
        for w in workers:  # what the worker now computes on (a checkpoint's refresh)
            self.pulled[w] = self.version
            self.stale.sent(w, self.shard.active)

    def _reply(self, w: int, staleness: int, lead: int) -> None:
        info = protocol.encode_info(Info(staleness, lead, self.version))
        sends = [self.comm.isend(self.shard.slices(b), w, chunk=b, tag=Kind.PULL)
                 for b in self.shard.active]  # fmt: skip
        sends.append(self.comm.isend(info, w, tag=Kind.INFO))
        try:
            wait_all(sends)  # before the next update changes the slices
        except CommError as err:
            self._drop(w, err)
            return
        self.pulled[w] = self.version
        self.stale.sent(w, self.shard.active)
        self.history.append((w, staleness, lead))


def serve_async(
    comm: Communicator,
    server: int,
    staleness: int | None,
    remedies: Remedies | None = None,
    forget: Callable[[int, str], None] | None = None,
) -> AsyncServer | None:
    """Run server ``server`` asynchronously until every worker has sent ``STOP``;
    ``forget(w, report)`` as it drops lost worker ``w`` (its heartbeat stops watching it;
    ``report`` says how it was lost)."""
    role = f"asynchronous parameter server {server} (rank {comm.rank})"
    try:
        spec: ServerSpec | None = recv_object(comm, 0, protocol.decode_spec, IDLE_TIMEOUT)
        if spec is None:
            return None
        shard = ShardOptimizer(spec, server)
        shard.share_initial(comm)
        loop = AsyncServer(comm, shard, staleness, remedies, forget)
        loop.run()
        return loop
    except CommError as err:
        raise CommError(f"{role}: {err} (ranks 0..W-1 are the workers, W.. the servers)") from err
