"""The gradient-synchronisation component: buckets of gradients averaged by one of our
allreduces while backward still runs.

:class:`GradientSync` has one job: keep the gradients of a model equal (their mean) over
the ranks of one communicator. It packs them into buckets
(:class:`~lightning_par.comm.buckets.GradientBuckets`, as DDP's ``bucket_cap_mb``: Li et al.,
"PyTorch Distributed", VLDB 2020) whose allreduce starts on a communication thread as soon as
backward has filled them, and :meth:`finish` waits for them after backward. Parameters that
became trainable after setup have no bucket: :meth:`finish` averages them too.

Used by the allreduce strategies (every rank), and by ``hybrid`` over each data-parallel
column of its grid.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from lightning_par.comm import CommTrace, Communicator
from lightning_par.comm.buckets import GradientBuckets, allreduce_buckets, average_unbucketed


class GradientSync:
    """Gradient buckets over ``comm`` summed by ``allreduce`` (one of
    :data:`lightning_par.collectives.ALGORITHMS`' functions), averaged by the world size.

    Args:
        allreduce: the collective.
        bucket_cap_mb: bucket size in MiB.
        overlap: start each bucket as soon as its gradients are ready (``False``: after
            backward).
        rebuild_for_late: after averaging late parameters, rebuild the buckets so that later
            steps overlap them too (the allreduce strategies); ``False``: average them every
            step without buckets (hybrid).
        skip_one_rank: no buckets over a communicator of one rank (``False``: buckets even
            then, so that the trace holds the same spans for every grid).
    """

    def __init__(
        self,
        allreduce: Callable,
        bucket_cap_mb: float,
        overlap: bool = True,
        rebuild_for_late: bool = True,
        skip_one_rank: bool = True,
    ) -> None:
        self.allreduce = allreduce
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.overlap = overlap
        self.rebuild_for_late = rebuild_for_late
        self.skip_one_rank = skip_one_rank
        self.buckets: GradientBuckets | None = None
        self._model: torch.nn.Module | None = None
        self._comm: Communicator | None = None
        self._trace: CommTrace | None = None
        self._backward_start = (0.0, 0.0)  # CommTrace.mark()

    def attach(
        self, model: torch.nn.Module, comm: Communicator, trace: CommTrace | None = None
    ) -> None:
        """Hook the buckets onto ``model``'s gradients (nothing to do for one rank: one
        process is its own average, so the step costs what one device's does)."""
        self.close()
        self._model, self._comm, self._trace = model, comm, trace
        if comm.world_size == 1 and self.skip_one_rank:
            return
        self.buckets = allreduce_buckets(
            model, self.allreduce, comm, bucket_cap_mb=self.bucket_cap_mb,
            overlap=self.overlap, trace=trace,
        )  # fmt: skip

    def no_sync(self) -> AbstractContextManager:
        """Gradient accumulation: no communication on the accumulating micro-steps."""
        return self.buckets.no_sync() if self.buckets is not None else nullcontext()

    def backward_started(self) -> None:
        """Mark the start of backward in the trace (its ``backward`` event)."""
        if self._trace is not None:
            self._backward_start = self._trace.mark()

    def finish(self, rank: int) -> None:
        """After backward: wait for every bucket, then average the late parameters."""
        if self.buckets is None or not self.buckets.enabled:
            return
        trace = self._trace
        if trace is None:
            self.buckets.synchronize()
        else:
            trace.close("backward", self._backward_start)
            with trace.span("wait for buckets"):
                self.buckets.synchronize()
        self._average_late_parameters()

    def _average_late_parameters(self) -> None:
        """Parameters that became trainable after setup have gradients but no bucket."""
        assert self.buckets is not None and self._model is not None and self._comm is not None
        late = self.buckets.unbucketed(self._model)
        if not late:
            return
        average_unbucketed(late, self.allreduce, self._comm)
        if self.rebuild_for_late:
            self.attach(self._model, self._comm, self._trace)

    def close(self) -> None:
        """Remove the hooks and stop the communication thread."""
        if self.buckets is not None:
            self.buckets.close()
            self.buckets = None
