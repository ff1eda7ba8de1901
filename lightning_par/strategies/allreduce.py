"""Allreduce data parallelism: gradients averaged by a hand-written collective.

:class:`AllReduceStrategy` is a thin adapter over
:class:`~lightning_par.strategies._base.ParStrategy`:

* :meth:`~AllReduceStrategy.sync_model_states`: rank 0's weights are broadcast down a tree
  (:func:`~lightning_par.collectives.tree_broadcast`);
* :meth:`~AllReduceStrategy.configure_sync`: the gradient-synchronisation component
  (:class:`~lightning_par.components.grad_sync.GradientSync`): buckets whose allreduce, the
  chosen collective, runs on a communication thread as soon as backward has filled them;
* ``post_backward`` waits for them and divides by the world size, before Lightning clips
  gradients and steps the optimiser; ``block_backward_sync`` (gradient accumulation,
  :class:`~lightning_par.strategies._base.ParStrategy`'s) turns synchronisation off.

This works on CPU with gloo (where Lightning ignores DDP communication hooks) and on
CUDA with NCCL or gloo. The registered names (``ring_allreduce``, ...) are one per key of
:data:`lightning_par.collectives.ALGORITHMS` (see :mod:`lightning_par.strategies.registry`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from typing_extensions import override

from lightning_par.collectives import (
    ALGORITHMS,
    get_allreduce,
    ring_allreduce,
    ring_tuning,
    tree_broadcast,
)
from lightning_par.comm import Communicator
from lightning_par.comm.buckets import GradientBuckets
from lightning_par.components.grad_sync import GradientSync
from lightning_par.strategies._base import ParStrategy
from lightning_par.strategies._resilience import Resilience


class AllReduceStrategy(ParStrategy):
    """Data parallelism whose gradients are averaged by a hand-written allreduce.

    Args:
        algorithm: a key of :data:`lightning_par.collectives.ALGORITHMS` (``"ring"``,
            ``"tree"``, ``"butterfly"``, ...).
        bucket_cap_mb: gradient bucket size in MiB (as DDP's ``bucket_cap_mb``).
        overlap: start each bucket's allreduce as soon as its gradients are ready
            (``False``: all buckets after backward).
        calibrate_ring: ``ring`` only: time the ring's message sizes on the ranks at start-up
            and keep the fastest in the cache folder
            (:mod:`~lightning_par.collectives.ring_tuning`). Without it the ring runs with a
            calibration kept for this machine, else with the sizes measured best for as many
            ranks as the host has cores, or for more ranks than cores.
        fault_tolerant: go on without a rank that is lost (killed, frozen past
            ``dead_peer_timeout``): the survivors re-form the group, run the interrupted
            step again and train the lost ranks' shards themselves, so the weights stay
            those of one process on the whole batch
            (:mod:`~lightning_par.components.fault_tolerance`); a lost rank 0's loggers,
            checkpoints and results are taken over by the first survivor
            (:mod:`._leader`; under ``popen`` the script's process keeps rank 0:
            :mod:`lightning_par.launch.script_keeper`).
        **kwargs: ``trace``, ``trace_dir``, ``start_method``, ``process_group_backend``,
            ``timeout`` (see :class:`~lightning_par.strategies._base.ParStrategy`) and the
            arguments Lightning passes. With ``trace`` the trace also holds a
            ``backward``/``bucket i`` timeline.
    """

    def __init__(
        self,
        algorithm: str | None = None,
        bucket_cap_mb: float = 4.0,
        overlap: bool = True,
        calibrate_ring: bool = False,
        fault_tolerant: bool = False,
        **kwargs: Any,
    ) -> None:
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
        super().__init__(**kwargs)
        self._algorithm_name = algorithm
        self.strategy_name = f"{algorithm}_allreduce"
        self.grad_sync = GradientSync(get_allreduce(algorithm), bucket_cap_mb, overlap)
        self.calibrate_ring = bool(calibrate_ring)
        #: the ring's message sizes and why (``ring`` on more than one rank, once set up)
        self.ring_choice: ring_tuning.Choice | None = None
        self.resilience = Resilience(self, fault_tolerant)

    @property
    def algorithm_name(self) -> str:
        return self._algorithm_name

    @property
    def buckets(self) -> GradientBuckets | None:
        """The gradient buckets (None: one rank, or not fitting)."""
        return self.grad_sync.buckets

    @override
    def sync_model_states(self) -> None:
        assert self.model is not None and self.comm is not None
        if self.world_size == 1:
            return  # one replica: nothing to agree on
        with torch.no_grad():
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                tree_broadcast(tensor.data, comm=self.comm, root=0)

    @override
    def configure_sync(self) -> None:
        assert self.model is not None and self.comm is not None
        if self._algorithm_name == "ring" and self.world_size > 1 and self.ring_choice is None:
            self.ring_choice = ring_tuning.choose(self.comm.group, self.num_processes,
                                                  calibrate_now=self.calibrate_ring)  # fmt: skip
            self.grad_sync.allreduce = partial(ring_allreduce, **self.ring_choice.tuning.options())
        self.grad_sync.attach(self.model, self.comm, self.trace)

    @override
    def gradient_buckets(self) -> GradientBuckets | None:
        return self.grad_sync.buckets

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        self.grad_sync.backward_started()

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        """Runs inside the optimiser closure: gradients are averaged before clipping/step."""
        self.grad_sync.finish(self.global_rank)
        self.resilience.settle()

    # ---- fault tolerance (a no-op without ``fault_tolerant``) ---------------------------------
    @property
    @override
    def is_global_zero(self) -> bool:
        """Rank 0, or the first survivor once rank 0 was lost (``fault_tolerant``)."""
        return self.resilience.leads()

    @property
    def survives_lost_rank_zero(self) -> bool:
        """Rank 0's loss too (the job's store outlives it: under ``popen`` the script's
        process keeps it and rank 0)."""
        return self.resilience.enabled

    @property
    def admits_replacements(self) -> bool:
        """A lost rank's replacement joins the running fit (``fault_tolerant``; started by
        its keeper under torchrun's ``--max-restarts``: :mod:`lightning_par.launch.keeper`)."""
        return self.resilience.enabled

    @property
    def survives_lost_workers(self) -> bool:
        """The launcher goes on when a rank other than 0 is lost (``fault_tolerant``)."""
        return self.resilience.enabled

    @override
    def check_before_launch(self, trainer: Any) -> None:
        super().check_before_launch(trainer)
        self.resilience.check_before_launch(trainer)

    @override
    def setup_distributed(self) -> None:
        self.resilience.leave_an_earlier_group()  # (a new Trainer in the same script)
        if self.resilience.joins_running_job():  # a lost rank's replacement
            self.resilience.join_running_job()
        else:
            super().setup_distributed()
        self.resilience.start()

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        self.resilience.setup(trainer)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self.resilience.sampler_kwargs(super().distributed_sampler_kwargs)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        return self.resilience.process_dataloader(super().process_dataloader(dataloader))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.resilience.at_step_start(self.regrouped)  # (replacements join here)
        output = super().training_step(*args, **kwargs)
        step = super().training_step
        return self.resilience.with_lost_shards(output, step, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kw: Any) -> Any:
        closure = self.resilience.retrying(closure, self.regrouped, self.lightning_module)
        return super().optimizer_step(optimizer, closure, model, **kw)

    def extras_for_joiners(self) -> dict[str, Any]:
        """What a replacement needs to send as the members do: the ring's message sizes."""
        if self.ring_choice is None:
            return {}
        return {"ring": ring_tuning.index_of(self.ring_choice.tuning)}

    def take_extras(self, extras: dict[str, Any]) -> None:
        """In a replacement: the members' ring message sizes."""
        if "ring" in extras:
            tuning = ring_tuning.CANDIDATES[extras["ring"]]
            self.ring_choice = ring_tuning.Choice(tuning, "the members' choice")
            self.grad_sync.allreduce = partial(ring_allreduce, **tuning.options())

    def regrouped(self) -> None:
        """The survivors met in a new default group: communicate over it."""
        assert self.model is not None
        self.comm = Communicator(trace=self.trace, names=self.resilience.members)
        self.grad_sync.attach(self.model, self.comm, self.trace)
        self.resilience.regrouped(self.lightning_module.trainer)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self.resilience.train_ended()

    @override
    def teardown(self) -> None:
        self.resilience.teardown()
        self.grad_sync.close()
        super().teardown()
