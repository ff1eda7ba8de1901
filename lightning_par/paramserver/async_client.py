"""The worker side of asynchronous SGD (see :mod:`lightning_par.paramserver.asynchronous`)."""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_par.comm import Event, wait_all
from lightning_par.comm.buckets import Bucket
from lightning_par.paramserver.asynchronous import (
    INFO,
    ONE_BUCKET_MB,
    PULL,
    WORK_TAG,
)
from lightning_par.paramserver.messages import IDLE_TIMEOUT, STEP, STOP
from lightning_par.paramserver.work import NEXT, NONE
from lightning_par.paramserver.worker import ParameterClient


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
