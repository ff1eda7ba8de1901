"""The worker side of asynchronous SGD (the servers: :mod:`lightning_par.paramserver.asynchronous`).

The pushes and pulls are the synchronous client's
(:class:`~lightning_par.paramserver.links.ServerLinks`, one bucket for the whole gradient);
what differs is around them: headers are posted without waiting, the servers answer each
push with an ``INFO`` message (the update's staleness), worker 0 asks server 0 for batches
(``NEXT``), and ``PULL`` takes the servers' newest weights.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import torch
from torch import nn

from lightning_par.comm import CommTrace, Event, Handle
from lightning_par.paramserver import protocol
from lightning_par.paramserver.clipping import GradClip, clip_flat
from lightning_par.paramserver.messages import post_headers
from lightning_par.paramserver.protocol import IDLE_TIMEOUT, Command, Kind
from lightning_par.paramserver.worker import ParameterClient

#: A bucket size larger than any model: the whole gradient in one push.
ONE_BUCKET_MB = 1e6


class AsyncParameterClient(ParameterClient):
    """A worker of asynchronous SGD: pushes its gradient after backward, takes back the
    weights and the staleness of its update from each server; talks to the servers alone.

    With a trace, each applied update is an :class:`~lightning_par.comm.Event` named
    ``staleness`` whose ``micro_batch`` field holds the staleness.

    ``local_clip`` clips each push (this worker's whole gradient) before it leaves, as one
    process on that batch would (:func:`~lightning_par.paramserver.clipping.clip_flat`);
    the servers then apply it as it comes.

    Attributes:
        updates: ``(step, staleness, lead)`` per applied update of this worker, the
            largest over the servers (each server counts its own updates).
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, *args: Any,
                 local_clip: GradClip | None = None, **kwargs: Any) -> None:  # fmt: skip
        self.local_clip = local_clip
        kwargs.setdefault("bucket_cap_mb", ONE_BUCKET_MB)  # one push after backward
        self.updates: list[tuple[int, int, int]] = []
        self._info: list[tuple[int, Handle]] = []
        self._info_step = 0
        self._trace = kwargs.get("trace")
        self.sampler: Any = None  # a SharedBatchSampler when the workers share batches
        # The main thread (asking for work) and the communication thread (pushing) both
        # send headers; one at a time, so each header is built and posted whole.
        self._post = threading.RLock()
        super().__init__(module, optimizer, *args, **kwargs)
        if local_clip is not None and len(self.buckets.buckets) != 1:
            raise ValueError(
                "async_sgd clips each worker's whole gradient before its one push; this model's "
                f"gradient makes {len(self.buckets.buckets)} buckets (parameters of several "
                "dtypes or devices)"
            )

    def _headers(self, command: Command) -> list[tuple[int, Handle]]:
        """Post a header to every server without waiting (see
        :func:`~lightning_par.paramserver.messages.post_headers`)."""
        handles = post_headers(self.comm, self.servers, self.header(command))
        return list(enumerate(handles))

    def next_batch(self, epoch: int, num_batches: int) -> tuple[int, int]:
        """Ask server 0 for this worker's next ``(epoch, batch)`` (batch NONE: epoch done).

        The answer comes on its own tag (``WORK``), so it cannot be taken for weights the
        communication thread waits for from server 0."""
        reply = protocol.work_buffer()
        handle = self.comm.irecv(reply, self.servers[0], tag=Kind.WORK)
        with self._post:
            header = self.header(Command.NEXT, step=epoch, count=num_batches)
            sent = post_headers(self.comm, self.servers[:1], header)
        sent[0].wait()
        handle.wait(IDLE_TIMEOUT)
        return protocol.decode_work(reply)

    def _open_step(self) -> list[tuple[int, Handle]]:
        return self._headers(Command.STEP)  # waited for with the push

    def _push(self, bucket: Any) -> None:
        if self.local_clip is not None:  # the whole gradient: one bucket
            clip_flat(bucket.views, self.local_clip)
        with self._post:
            super()._push(bucket)

    def _pushed(self, bucket: int) -> None:
        if bucket == len(self.buckets.buckets) - 1:  # buckets go in index order
            self._info_step = self.step
            self._info = [
                (s, self.comm.irecv(protocol.info_buffer(), server, step=self.step, tag=Kind.INFO))
                for s, server in enumerate(self.servers)
            ]

    def wait_bucket(self, b: int) -> None:
        super().wait_bucket(b)
        if not self.links.pending and self._info:
            infos = [protocol.decode_info(handle.wait()) for _, handle in self._info]
            self._info = []
            staleness = max(info.staleness for info in infos)
            self.updates.append((self._info_step, staleness, max(info.lead for info in infos)))
            if self._trace is not None:  # the staleness rides in the event's number field
                now = self._trace.now()
                self._trace.events.append(Event(self.rank, "staleness", now, now, staleness))

    def _exchange(self, command: Command) -> None:
        """Send ``command`` and take the weights the servers answer with."""
        self.settle()
        sends = self._headers(command)
        self.links.post_pulls(Kind.PULL)  # before waiting on the headers (see _headers)
        self.links.wait_sends(sends)
        self.settle()

    def refresh(self) -> None:
        """Take the servers' current weights (the latest of all workers' updates)."""
        self._exchange(Command.PULL)

    def close(self) -> None:
        """Stop; the servers answer with their final weights once every worker has stopped,
        so every worker ends with the same model (every worker calls this)."""
        self._exchange(Command.STOP)
        self.remove_hooks()

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


def staleness_histogram(traces: CommTrace | list[CommTrace]) -> dict[int, int]:
    """How many applied updates had each staleness, from one or more workers' traces."""
    traces = [traces] if isinstance(traces, CommTrace) else traces
    counts = Counter(
        e.micro_batch for t in traces for e in t.events if e.name == "staleness"
    )  # fmt: skip
    return dict(sorted(counts.items()))
