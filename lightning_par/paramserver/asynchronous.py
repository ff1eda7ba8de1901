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
(:class:`~lightning_par.paramserver.work.WorkQueue`). Losing worker 0 ends the job.

Workers push their whole gradient in one message after backward (one gradient bucket): a
server reads one worker's message at a time, and a push spread over a backward would hold
the server, and every other worker, for that backward.
"""

from __future__ import annotations

import queue
import sys
import threading

import torch
import torch.distributed as dist

from lightning_par.comm import CommError, Communicator, wait_all
from lightning_par.paramserver.messages import (
    GET_STATE,
    IDLE_TIMEOUT,
    SET_STATE,
    STEP,
    STOP,
    ServerSpec,
    recv_object,
    send_object,
)
from lightning_par.paramserver.server import ShardOptimizer
from lightning_par.paramserver.work import NEXT, WorkQueue

#: A bucket size larger than any model: the whole gradient in one push.
ONE_BUCKET_MB = 1e6
#: Header command: send me the current weights (not a step; used for checkpoints, the end).
PULL = 4
INFO = 3  # staleness of the update just applied, lead over the slowest at reply, version
#: Numbers after the hyperparameters in every header: the (epoch, batch) the worker last
#: trained (acknowledges shared work; NONE without it).
ACK = 2
#: The gloo tag of a worker's next batch number (every other message uses tag 0).
WORK_TAG = 7


class AsyncServer:
    """One server's asynchronous (or stale synchronous) update loop."""

    def __init__(self, comm: Communicator, shard: ShardOptimizer, staleness: int | None) -> None:
        self.comm, self.shard, self.staleness = comm, shard, staleness
        workers = shard.spec.num_workers
        self.running = set(range(workers))
        self.stopped: list[int] = []
        self.clock = [0] * workers  # pushes applied per worker
        self.pulled = [0] * workers  # the version each worker last received
        self.version = 0
        self.waiting: dict[int, int] = {}  # worker -> staleness of its last update, unanswered
        self.held: dict[int, tuple[list[torch.Tensor], torch.Tensor]] = {}  # s=0: this round
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
                self._drop(w, payload)
                continue
            command, step = int(header[0]), int(header[1])
            try:
                self._handle(w, command, step, header, payload)
            except (CommError, RuntimeError) as err:
                if command not in (STEP, NEXT, PULL):
                    raise
                self._drop(w, err)  # it died before taking our answer

    def _read(self, w: int) -> None:
        spec, shard = self.shard.spec, self.shard
        size = 2 + sum(len(x) for x in spec.schemas) + ACK
        try:
            while True:
                header = torch.zeros(size, dtype=torch.float64)
                self.comm.irecv(header, w, tag="control").wait(IDLE_TIMEOUT)
                command, payload = int(header[0]), None
                if command == STEP:
                    payload = [
                        torch.empty(shard.flat[b].numel() + len(shard.layout[b]), dtype=spec.dtype)
                        for b in shard.active
                    ]
                    wait_all([self.comm.irecv(buf, w, step=int(header[1]), chunk=b, tag="push")
                              for b, buf in zip(shard.active, payload)])  # fmt: skip
                elif command == SET_STATE:
                    payload = recv_object(self.comm, w)
                self.inbox.put((w, header, payload))
                if command == STOP:
                    return
        except (CommError, RuntimeError) as err:
            self.inbox.put((w, None, err))

    def _handle(self, w: int, command: int, step: int, header: torch.Tensor, payload) -> None:
        if command == STEP:
            self.work.trained(w, int(header[-2]), int(header[-1]))
            self._push(w, payload, header[2:-ACK].clone())
        elif command == NEXT:  # step: the epoch; the last number: its number of batches
            reply = torch.tensor(self.work.take(w, step, int(header[-1])), dtype=torch.int64)
            dist.send(reply, self.comm._global[w], tag=WORK_TAG)
        elif command == GET_STATE:
            send_object(self.comm, self.shard.state_slices(), w)
        elif command == SET_STATE:
            self.shard.load_full(payload)
        elif command == PULL:
            self._send_weights([w])
        elif command == STOP:
            self.running.discard(w)
            self.stopped.append(w)
            self._release()
            self._finish()
        else:
            raise RuntimeError(f"unknown command {command} from worker {w}")

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

    def _push(self, w: int, bufs: list[torch.Tensor], hyper: torch.Tensor) -> None:
        shard = self.shard
        if self.staleness == 0:
            self.held[w] = (bufs, hyper)
            self._release()
            return
        shard.set_hyper(hyper.tolist())  # this worker's schedule
        for b, buf in zip(shard.active, bufs):
            n = shard.flat[b].numel()
            shard.apply(b, buf[:n], buf[n:] > 0)
        self.waiting[w] = self.version - self.pulled[w]
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
        shard.set_hyper(self.held[order[0]][1].tolist())
        for i, b in enumerate(shard.active):
            total = self.held[order[0]][0][i].clone()
            for w in order[1:]:
                total += self.held[w][0][i]  # worker order: the same sum as synchronous_step
            n = shard.flat[b].numel()
            shard.apply(b, total[:n].div_(len(order)), total[n:] > 0)
        self.version += 1
        self.held.clear()
        for w in order:
            self.clock[w] += 1
            self._reply(w, 0, 0)

    def _send_weights(self, workers: list[int]) -> None:
        wait_all([self.comm.isend(self.shard.flat[b], w, chunk=b, tag="pull")
                  for w in workers for b in self.shard.active])  # fmt: skip

    def _reply(self, w: int, staleness: int, lead: int) -> None:
        info = torch.tensor([float(staleness), float(lead), float(self.version)])
        sends = [self.comm.isend(self.shard.flat[b], w, chunk=b, tag="pull")
                 for b in self.shard.active]  # fmt: skip
        sends.append(self.comm.isend(info, w, tag="staleness"))
        try:
            wait_all(sends)  # before the next update changes the slices
        except CommError as err:
            self._drop(w, err)
            return
        self.pulled[w] = self.version
        self.history.append((w, staleness, lead))


def serve_async(comm: Communicator, server: int, staleness: int | None) -> AsyncServer | None:
    """Run server ``server`` asynchronously until every worker has sent ``STOP``."""
    role = f"asynchronous parameter server {server} (rank {comm.rank})"
    try:
        spec: ServerSpec | None = recv_object(comm, 0, IDLE_TIMEOUT)
        if spec is None:
            return None
        shard = ShardOptimizer(spec, server)
        for b in shard.active:  # worker 0's initial weights, then to every worker
            comm.recv(shard.flat[b], 0, chunk=b, tag="init")
        wait_all([comm.isend(shard.flat[b], w, chunk=b, tag="init")
                  for b in shard.active for w in range(spec.num_workers)])  # fmt: skip
        loop = AsyncServer(comm, shard, staleness)
        loop.run()
        return loop
    except CommError as err:
        raise CommError(f"{role}: {err} (ranks 0..W-1 are the workers, W.. the servers)") from err


# the worker side, re-exported here (it imports the constants above)
from lightning_par.paramserver.async_client import AsyncParameterClient  # noqa: E402

__all__ = ["AsyncParameterClient", "AsyncServer", "serve_async"]
