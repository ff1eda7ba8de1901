"""Asynchronous SGD on the parameter servers (Downpour style), with bounded staleness.

The synchronous server (:func:`~lightning_par.paramserver.server.synchronous_step`) waits for
every worker's push before it updates. Here a server takes the workers' messages in the
order they arrive (a receive *from any rank*) and, for each push, at once runs the user's
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

Workers push their whole gradient in one message after backward (one gradient bucket): a
server reads one worker's message at a time, and a push spread over a backward would hold
the server, and every other worker, for that backward.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_par.comm import CommError, Communicator, Event, wait_all
from lightning_par.comm.buckets import Bucket
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
from lightning_par.paramserver.work import NEXT, NONE, WorkQueue
from lightning_par.paramserver.worker import ParameterClient

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


def recv_any(comm: Communicator, buf: torch.Tensor) -> int:
    """Receive ``buf`` from whichever rank sends first; return that rank (in ``comm``)."""
    work = dist.irecv(buf, src=None, group=comm.group)
    try:
        work.wait(IDLE_TIMEOUT)
    except RuntimeError as err:
        raise CommError(f"rank {comm.rank}: receive from any worker failed: {err}") from err
    return int(work._source_rank())  # the group's rank; torch has no public accessor


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

    def run(self) -> None:
        spec = self.shard.spec
        header = torch.zeros(2 + sum(len(x) for x in spec.schemas) + ACK, dtype=torch.float64)
        while self.running:
            w = recv_any(self.comm, header)
            command, step = int(header[0]), int(header[1])
            if command == STEP:
                self.work.trained(w, int(header[-2]), int(header[-1]))
                self._push(w, step, header[2:-ACK].clone())
            elif command == NEXT:  # step: the epoch; the last number: its number of batches
                reply = torch.tensor(self.work.take(w, step, int(header[-1])), dtype=torch.int64)
                dist.send(reply, self.comm._global[w], tag=WORK_TAG)
            elif command == GET_STATE:
                send_object(self.comm, self.shard.state_slices(), w)
            elif command == SET_STATE:
                self.shard.load_full(recv_object(self.comm, w))
            elif command == PULL:
                self._send_weights([w])
            elif command == STOP:
                self.running.discard(w)
                self.stopped.append(w)
                self._release()
                if not self.running:  # the final weights, to every worker
                    self._send_weights(self.stopped)
            else:
                raise RuntimeError(f"unknown command {command} from worker {w}")

    def _push(self, w: int, step: int, hyper: torch.Tensor) -> None:
        shard = self.shard
        bufs = [
            torch.empty(shard.flat[b].numel() + len(shard.layout[b]), dtype=shard.spec.dtype)
            for b in shard.active
        ]
        wait_all([self.comm.irecv(buf, w, step=step, chunk=b, tag="push")
                  for b, buf in zip(shard.active, bufs)])  # fmt: skip
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
        wait_all(sends)  # before the next update changes the slices
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


class AsyncParameterClient(ParameterClient):
    """A worker of asynchronous SGD: pushes its gradient after backward, takes back the
    weights and the staleness of its update from each server; talks to the servers alone.

    With a trace, each applied update is an :class:`~lightning_par.comm.Event` named
    ``staleness`` whose ``micro_batch`` field holds the staleness.

    Attributes:
        updates: ``(step, staleness, lead)`` per applied update of this worker, the
            largest over the servers (each server counts its own updates).
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, *args: Any,
                 **kwargs: Any) -> None:  # fmt: skip
        kwargs.setdefault("bucket_cap_mb", ONE_BUCKET_MB)  # one push after backward
        self.updates: list[tuple[int, int, int]] = []
        self._info: list[tuple[int, Any]] = []
        self._info_step = 0
        self._trace = kwargs.get("trace")
        self.sampler: Any = None  # a SharedBatchSampler when the workers share batches
        self.trained: tuple[int, int] = (NONE, NONE)  # acknowledged with the next push
        # All messages between two ranks share one gloo tag and match in the order posted:
        # a header and its push must not be split by the main thread's request for work.
        self._post = threading.RLock()
        super().__init__(module, optimizer, *args, **kwargs)

    def _headers(self, command: int) -> list[Any]:
        """Post a header to every server without waiting: servers take workers in any order,
        and a worker blocked on one server's header while another server waits for its
        push would deadlock the two servers against two workers."""
        header = self._header(command, self.step, self.trained)
        return [self.comm.isend(header, server, tag="control") for server in self.servers]

    def _header(self, command: int, step: int, last: tuple[int, int]) -> torch.Tensor:
        values = [float(command), float(step), *self.lrs(), *map(float, last)]
        return torch.tensor(values, dtype=torch.float64)

    def next_batch(self, epoch: int, num_batches: int) -> tuple[int, int]:
        """Ask server 0 for this worker's next ``(epoch, batch)`` (batch NONE: epoch done).

        One header, ``num_batches`` in its last number; the answer comes on its own tag, so
        it cannot be taken for weights the communication thread waits for from server 0."""
        reply = torch.zeros(2, dtype=torch.int64)
        handle = dist.irecv(reply, self.comm._global[self.servers[0]], tag=WORK_TAG)
        with self._post:  # not between another header and its push (see _push)
            header = self._header(NEXT, epoch, (NONE, num_batches))
            sent = self.comm.isend(header, self.servers[0], tag="control")
        sent.wait()
        handle.wait(IDLE_TIMEOUT)
        return int(reply[0]), int(reply[1])

    def _push(self, bucket: Bucket) -> None:
        with self._post:
            self._post_push(bucket)

    def _post_push(self, bucket: Bucket) -> None:
        b = bucket.index
        sends = self._headers(STEP) if b == 0 else []
        pulls = []
        for s, sl in enumerate(self.layout[b]):
            if not sl:
                continue
            grads = [bucket.views[i].flatten()[pc.start : pc.stop] for i, pc in sl]
            flags = torch.stack([bucket.flags[i] for i, _ in sl])
            server = self.servers[s]
            message = torch.cat([*grads, flags])
            sends.append(self.comm.isend(message, server, step=self.step, chunk=b, tag="push"))
            pulls.append(
                (s, self.comm.irecv(self.pull[b][s], server, step=self.step, chunk=b, tag="pull"))
            )
        self.pending[b] = pulls
        if b == len(self.buckets.buckets) - 1:  # buckets go in index order
            self._info_step = self.step
            self._info = [
                (s, self.comm.irecv(torch.zeros(INFO), server, step=self.step, tag="staleness"))
                for s, server in enumerate(self.servers)
            ]
        wait_all(sends)

    def wait_bucket(self, b: int) -> None:
        super().wait_bucket(b)
        if not self.pending and self._info:
            values = [handle.wait() for _, handle in self._info]
            self._info = []
            staleness = max(int(v[0]) for v in values)
            self.updates.append((self._info_step, staleness, max(int(v[1]) for v in values)))
            if self._trace is not None:  # the staleness rides in the event's number field
                now = self._trace.now()
                self._trace.events.append(Event(self.rank, "staleness", now, now, staleness))

    def refresh(self) -> None:
        """Take the servers' current weights (the latest of all workers' updates)."""
        self.settle()
        sends = self._headers(PULL)
        self._post_pulls()  # before waiting on the headers (see _headers)
        wait_all(sends)
        self.settle()

    def _post_pulls(self) -> None:
        for b, per_server in enumerate(self.layout):
            self.pending[b] = [
                (s, self.comm.irecv(self.pull[b][s], self.servers[s], chunk=b, tag="pull"))
                for s, sl in enumerate(per_server)
                if sl
            ]

    def close(self) -> None:
        """Stop; the servers answer with their final weights once every worker has stopped,
        so every worker ends with the same model (every worker calls this)."""
        self.settle()
        sends = self._headers(STOP)
        self._post_pulls()
        wait_all(sends)
        self.settle()
        for hook in self._hooks:
            hook.remove()
        self.buckets.close()

    def gather_state(self) -> dict[str, Any]:
        """Worker 0 gathers the full optimiser state; others return their own (no state)."""
        if self.rank != 0:
            self.settle()
            return self.optimizer.state_dict()
        return super().gather_state()

    def load_state(self, state_dict: dict[str, Any]) -> None:
        """Worker 0 sends the state to the servers; the others take the hyperparameters."""
        if self.rank != 0:
            self.settle()
            self.optimizer.load_state_dict({**state_dict, "state": {}})
            return
        super().load_state(state_dict)
