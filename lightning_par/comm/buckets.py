"""Bucketed gradient averaging that overlaps communication with the backward pass.

The design of PyTorch DDP's reducer (Li et al., "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB 2020), written in Python so it can be read:

* parameters are grouped, in reverse order of definition (the order backward produces
  their gradients), into buckets of about ``bucket_cap_mb`` megabytes;
* a ``post_accumulate_grad`` hook marks a gradient ready; once a bucket is complete its
  gradients are copied into one flat buffer and the bucket's allreduce starts on a
  communication thread while backward goes on computing earlier layers;
* buckets always start in index order, so every rank runs the same sequence of
  collectives even if autograd finishes gradients in a slightly different order;
* :meth:`GradientBuckets.synchronize` (after backward) starts the buckets still waiting
  (parameters unused this step: a missing gradient counts as zeros), waits for all of
  them and hands each bucket to ``finish`` (the allreduce's copies the averages back).

Each bucket carries one extra element per parameter, 1 where this rank has a gradient,
so after the sum a parameter that no rank used keeps ``grad = None`` as in one process.

What happens to a full bucket is a parameter: :class:`GradientBuckets` hands each one to
``communicate(bucket)`` (on the communication thread) and, after all of them are done, to
``finish(bucket)``. :func:`allreduce_buckets` plugs in an allreduce and the average; the
parameter server plugs in a push to its servers and a pull of the new weights.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch
from torch import nn

from lightning_par.comm.p2p import Communicator
from lightning_par.comm.trace import CommTrace, Event

AllReduceFn = Callable[..., torch.Tensor]
BucketFn = Callable[["Bucket"], None]


class Bucket:
    """Parameters whose gradients travel together in one flat buffer."""

    def __init__(self, index: int, params: list[nn.Parameter]) -> None:
        self.index, self.params = index, params
        numel = sum(p.numel() for p in params)
        first = params[0]
        # Gradients followed by one "has a gradient" flag per parameter.
        self.buffer = torch.zeros(numel + len(params), dtype=first.dtype, device=first.device)
        self.views = []
        offset = 0
        for p in params:
            self.views.append(self.buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.flags = self.buffer[offset:]
        self.ready: set[int] = set()
        self.future: Future | None = None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def pack(self, scale: float | None = None) -> None:
        """Copy every gradient into the buffer, times ``scale`` if given (the average's
        division rides on the copy, one pass over the bytes, as in DDP's reducer); a
        missing gradient counts as zeros, flagged 0."""
        for i, (p, view) in enumerate(zip(self.params, self.views)):
            grad = p.grad
            if grad is None:
                view.zero_()
                self.flags[i] = 0
                continue
            if scale is None:
                view.copy_(grad)
            else:
                torch.mul(grad, scale, out=view)
            self.flags[i] = 1

    def unpack(self) -> None:
        """Copy the (summed, already scaled) buffer back into the gradients.

        Into the gradient tensors themselves, not making them views of the buffer (DDP's
        ``gradient_as_bucket_view``): under ``zero_grad(set_to_none=True)`` autograd
        allocates fresh gradients every step anyway, and freeing the old ones at the end
        of backward instead of at ``zero_grad`` let the allocator hand their pages back to
        the system: 1.6-1.9x the page faults and 8-11 % more CPU per step (wide MLP, 2
        ranks).
        """
        flags = self.flags.tolist()
        for p, view, used in zip(self.params, self.views, flags):
            grad = p.grad
            if used == 0:
                p.grad = None  # no rank had a gradient: leave it to the optimiser as None
            elif grad is None:
                p.grad = view.clone()  # only other ranks had one
            else:
                grad.copy_(view)


def make_buckets(params: list[nn.Parameter], bucket_cap_bytes: int) -> list[Bucket]:
    """Group ``params`` (already in reverse order) into buckets per dtype and device."""
    buckets: list[Bucket] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        starts_new = current and (
            size + nbytes > bucket_cap_bytes
            or p.dtype != current[0].dtype
            or p.device != current[0].device
        )
        if starts_new:
            buckets.append(Bucket(len(buckets), current))
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(Bucket(len(buckets), current))
    return buckets


class GradientBuckets:
    """Send the gradients of ``module`` in buckets as backward produces them.

    Args:
        module: the model; its parameters that require gradients travel.
        communicate: what to do with a full bucket, e.g. sum its buffer over the ranks;
            runs on the communication thread (``overlap``) or the caller's.
        finish: what to do with each bucket once all are communicated, in
            :meth:`synchronize` (e.g. :meth:`Bucket.unpack`).
        bucket_cap_mb: bucket size in megabytes (MiB).
        overlap: start buckets during backward on a communication thread; ``False``
            starts all of them after backward, on the calling thread.
        trace: where to record one ``bucket <i>`` event per bucket (launch to done).
        rank: the rank recorded in those events.
        scale: multiply the gradients by this while packing them (``None``: copy as is).
    """

    def __init__(
        self,
        module: nn.Module,
        communicate: BucketFn,
        finish: BucketFn,
        bucket_cap_mb: float = 25.0,
        overlap: bool = True,
        trace: CommTrace | None = None,
        rank: int = 0,
        scale: float | None = None,
    ) -> None:
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        # an emptied parameter (a layer another pipeline stage holds) has nothing to average
        params = [p for p in module.parameters() if p.requires_grad and p.numel()]
        self.communicate, self.finish, self.overlap = communicate, finish, overlap
        self.trace, self.rank, self.scale = trace, rank, scale
        self.buckets = make_buckets(list(reversed(params)), int(bucket_cap_mb * 2**20))
        self._where = {id(p): b for b in self.buckets for p in b.params}
        self._next = 0  # first bucket not started yet
        self._lock = threading.Lock()
        self.enabled = True
        self._executor = (
            ThreadPoolExecutor(1, thread_name_prefix="lightning_par-buckets") if overlap else None
        )
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]

    def unbucketed(self, module: nn.Module) -> list[nn.Parameter]:
        """Parameters of ``module`` with a gradient but no bucket: trainable only since the
        buckets were made (every rank must agree on them, as on the buckets)."""
        return [p for p in module.parameters() if p.grad is not None and id(p) not in self._where]

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) inside this block."""
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous

    def _grad_ready(self, param: torch.Tensor) -> None:
        if not (self.enabled and self.overlap):
            return
        bucket = self._where[id(param)]
        with self._lock:
            bucket.ready.add(id(param))
            self._start_ready_buckets()

    def _start_ready_buckets(self) -> None:
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if len(bucket.ready) < len(bucket.params):
                return
            self._start(bucket)

    def _start(self, bucket: Bucket) -> None:
        bucket.pack(self.scale)
        self._next += 1
        if self._executor is None:
            self._run(bucket, None)
            return
        event = None
        if bucket.buffer.is_cuda:  # the copy above ran on this thread's stream
            event = torch.cuda.Event()
            event.record()
        bucket.future = self._executor.submit(self._run, bucket, event)

    def _run(self, bucket: Bucket, ready_event) -> None:
        if ready_event is not None:
            torch.cuda.current_stream(bucket.buffer.device).wait_event(ready_event)
        start = self.trace.now() if self.trace is not None else 0.0
        self.communicate(bucket)
        if self.trace is not None:
            self.trace.events.append(
                Event(self.rank, f"bucket {bucket.index}", start, self.trace.now())
            )

    def synchronize(self) -> None:
        """Finish every bucket and write the averaged gradients back (call after backward)."""
        with self._lock:
            for bucket in self.buckets[self._next :]:
                bucket.ready.update(id(p) for p in bucket.params)
            self._start_ready_buckets()
        try:
            for bucket in self.buckets:
                if bucket.future is not None:
                    bucket.future.result()  # re-raises a failed collective here
                self.finish(bucket)
        finally:
            for bucket in self.buckets:
                bucket.ready.clear()
                bucket.future = None
            self._next = 0

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def allreduce_buckets(
    module: nn.Module,
    allreduce: AllReduceFn,
    comm: Communicator,
    bucket_cap_mb: float = 25.0,
    overlap: bool = True,
    trace: CommTrace | None = None,
) -> GradientBuckets:
    """Average the gradients of ``module`` over the ranks of ``comm`` with ``allreduce`` (an
    in-place sum such as :func:`lightning_par.collectives.ring_allreduce`), bucket by bucket.

    Each gradient is divided by the world size as it is copied into its bucket and the
    sum copied back (:meth:`Bucket.unpack`): two passes over the gradients' bytes besides
    the collective, where copy, divide and copy back took three.
    """
    return GradientBuckets(
        module,
        communicate=lambda bucket: allreduce(bucket.buffer, comm=comm),
        finish=Bucket.unpack,
        bucket_cap_mb=bucket_cap_mb,
        overlap=overlap,
        trace=trace,
        rank=comm.global_rank,
        scale=1.0 / comm.world_size,
    )


def average_unbucketed(params: list[nn.Parameter], allreduce: AllReduceFn, comm: Communicator):
    """Average the gradients of ``params`` (trainable only since the buckets were made: an
    unfrozen layer, a new param group) over the ranks of ``comm``, in one message. torch
    DDP's reducer never synchronises such parameters: its replicas silently drift apart."""
    if not params or comm.world_size == 1:
        return
    flat = torch.cat([p.grad.detach().reshape(-1) for p in params])
    allreduce(flat, comm=comm)
    flat /= comm.world_size
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.detach().copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n
