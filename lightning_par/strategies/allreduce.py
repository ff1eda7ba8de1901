"""Allreduce data parallelism: DDP's plumbing with our own gradient synchronisation.

:class:`AllReduceStrategy` keeps everything of Lightning's ``DDPStrategy`` (launcher,
process group, ranks, sampler, ``barrier``/``broadcast``/``reduce``, checkpoints) and
replaces only the ``DistributedDataParallel`` wrapper:

* ``configure_ddp``: no wrapper; rank 0's weights are broadcast down a tree
  (:func:`~lightning_par.collectives.tree_broadcast`) and gradient buckets are set up
  (:class:`~lightning_par.strategies.buckets.GradientBuckets`);
* during backward, full buckets are summed by the chosen collective on a
  communication thread; ``post_backward`` waits for them and divides by the world size,
  before Lightning clips gradients and steps the optimiser;
* ``block_backward_sync`` (gradient accumulation) turns synchronisation off.

This works on CPU with gloo (where Lightning ignores DDP communication hooks) and on
CUDA with NCCL or gloo. The five registered strategies differ only in
:attr:`AllReduceStrategy.algorithm`.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, ClassVar

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from lightning_par.collectives import ALGORITHMS, get_allreduce, tree_broadcast
from lightning_par.comm import (
    CommTrace,
    Communicator,
    Event,
    choose_start_method,
    default_timeout,
    one_thread_after_fork,
)
from lightning_par.strategies.buckets import GradientBuckets

START_METHODS = ("popen", "spawn", "fork", "forkserver")
#: DDPStrategy arguments that Lightning itself may pass.
PLUMBING_ARGUMENTS = {
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
}


class AllReduceStrategy(DDPStrategy):
    """Data parallelism whose gradients are averaged by a hand-written allreduce.

    Args:
        algorithm: ``"ring"``, ``"tree"``, ``"butterfly"``, ``"all_to_all"`` or
            ``"master_worker"`` (default: the subclass's :attr:`algorithm`).
        bucket_cap_mb: gradient bucket size in MiB (as DDP's ``bucket_cap_mb``).
        overlap: start each bucket's allreduce as soon as its gradients are ready
            (``False``: all buckets after backward).
        trace: record every message and a ``backward``/``bucket i`` timeline in
            :attr:`trace` (a :class:`~lightning_par.comm.CommTrace`).
        start_method: how Lightning starts the extra ranks; default
            :func:`~lightning_par.comm.choose_start_method` (``fork`` in notebooks,
            tests and CPU scripts with at most one core per rank, else ``popen``); under
            torchrun/SLURM the processes already exist and none are started.
        timeout: how long any collective or receive may wait before the run fails,
            naming the rank (default :func:`~lightning_par.comm.default_timeout`: 60 s,
            ``LIGHTNING_PAR_TIMEOUT`` seconds if set; Lightning's own default is 30 min).
            Raise it when rank 0 may spend longer alone, e.g. writing a large checkpoint.
        **kwargs: ``accelerator``, ``parallel_devices``, ``cluster_environment``,
            ``checkpoint_io``, ``precision_plugin`` and ``process_group_backend``, as
            for ``DDPStrategy``.

    Ranks started with ``fork`` compute on one intra-op thread each: a forked child
    hangs in OpenMP if its parent had already used OpenMP threads. So in scripts the
    default is ``fork`` only where each rank gets one core anyway, and ``popen`` (ranks
    use cores/ranks threads) elsewhere.
    """

    #: The collective of this strategy, a key of :data:`lightning_par.collectives.ALGORITHMS`.
    algorithm: ClassVar[str | None] = None

    def __init__(
        self,
        algorithm: str | None = None,
        bucket_cap_mb: float = 4.0,
        overlap: bool = True,
        trace: bool = False,
        start_method: str | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        **kwargs: Any,
    ) -> None:
        algorithm = algorithm or self.algorithm
        if algorithm is None:
            raise ValueError(
                f"AllReduceStrategy needs an algorithm: one of {sorted(ALGORITHMS)}, e.g. "
                "AllReduceStrategy(algorithm='ring') or strategy='ring_allreduce'"
            )
        get_allreduce(algorithm)  # unknown names fail here, before any process starts
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
            raise TypeError(f"bucket_cap_mb must be a number of MiB, got {bucket_cap_mb!r}")
        if not bucket_cap_mb > 0:
            raise ValueError(
                f"bucket_cap_mb must be > 0 MiB, got {bucket_cap_mb}; DDP's default is 25, "
                "smaller buckets start communicating earlier in backward"
            )
        unknown = sorted(set(kwargs) - PLUMBING_ARGUMENTS)
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unknown option(s) {unknown}: it accepts algorithm, "
                "bucket_cap_mb, overlap, trace, start_method, process_group_backend, timeout "
                f"and {sorted(PLUMBING_ARGUMENTS)} (torch DDP options do not apply: there is "
                "no DistributedDataParallel wrapper)"
            )
        if start_method is not None and start_method not in START_METHODS:
            raise ValueError(f"start_method={start_method!r}: choose one of {START_METHODS}")
        super().__init__(
            start_method=start_method or "popen",
            process_group_backend=process_group_backend,
            timeout=timeout or default_timeout(),
            **kwargs,
        )
        self._algorithm_name = algorithm
        self._allreduce = get_allreduce(algorithm)
        self._bucket_cap_mb = float(bucket_cap_mb)
        self._overlap = overlap
        self._trace_enabled = trace
        self._start_method_given = start_method is not None
        self.trace: CommTrace | None = None
        self.buckets: GradientBuckets | None = None
        self._backward_start = 0.0

    @property
    def algorithm_name(self) -> str:
        return self._algorithm_name

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            # torchrun, SLURM or run_on_ranks started the ranks: launch nothing (also in a
            # notebook, where Lightning would refuse its script launcher).
            self._start_method = "popen"
            self._launcher = _ExistingRanksLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
            return
        if not self._start_method_given:
            device = self.parallel_devices[0].type if self.parallel_devices else "cpu"
            self._start_method = choose_start_method(device, self.num_processes)
        super()._configure_launcher()

    def setup_environment(self) -> None:
        # (Inside a forked rank the cluster environment already reports LOCAL_RANK, so ask
        # the launcher object, inherited from the parent, how this process started.)
        if isinstance(self._launcher, _MultiProcessingLauncher) and self._start_method == "fork":
            one_thread_after_fork()
        super().setup_environment()

    def configure_ddp(self) -> None:
        """Instead of wrapping in ``DistributedDataParallel``: same start, own gradient sync."""
        assert self.model is not None
        self.trace = CommTrace(self.global_rank) if self._trace_enabled else None
        comm = Communicator(trace=self.trace)
        with torch.no_grad():
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                tree_broadcast(tensor.data, comm=comm, root=0)
        self.buckets = GradientBuckets(
            self.model,
            self._allreduce,
            comm,
            bucket_cap_mb=self._bucket_cap_mb,
            overlap=self._overlap,
            trace=self.trace,
        )
        if self.trace is not None:
            self.trace.clear()  # keep only training messages

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: no communication on the accumulating micro-steps."""
        if self.buckets is None:
            yield
            return
        with self.buckets.no_sync():
            yield

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        if self.trace is not None:
            self._backward_start = self.trace.now()

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        """Runs inside the optimiser closure: gradients are averaged before clipping/step."""
        if self.buckets is None or not self.buckets.enabled:
            return
        if self.trace is not None:
            backward = Event(self.global_rank, "backward", self._backward_start, self.trace.now())
            self.trace.events.append(backward)
            with self.trace.span("wait for buckets"):
                self.buckets.synchronize()
        else:
            self.buckets.synchronize()

    def teardown(self) -> None:
        if self.buckets is not None:
            self.buckets.close()
            self.buckets = None
        super().teardown()


class _ExistingRanksLauncher(_SubprocessScriptLauncher):
    """Every rank already runs this code: Lightning's script launcher then starts nothing,
    which is as safe in a notebook as anywhere."""

    @property
    def is_interactive_compatible(self) -> bool:
        return True


class RingAllReduceStrategy(AllReduceStrategy):
    """Gradients averaged by ring allreduce (reduce-scatter + all-gather)."""

    algorithm = "ring"


class TreeAllReduceStrategy(AllReduceStrategy):
    """Gradients averaged by tree allreduce (reduce to rank 0, broadcast back)."""

    algorithm = "tree"


class ButterflyAllReduceStrategy(AllReduceStrategy):
    """Gradients averaged by butterfly allreduce (recursive doubling)."""

    algorithm = "butterfly"


class AllToAllAllReduceStrategy(AllReduceStrategy):
    """Gradients averaged by all-to-all allreduce (teaching baseline)."""

    algorithm = "all_to_all"


class MasterWorkerAllReduceStrategy(AllReduceStrategy):
    """Gradients averaged by master-worker allreduce (teaching baseline)."""

    algorithm = "master_worker"
