"""Hybrid parallelism: data parallelism across replicas that are each split model-parallel.

The course's hybrid picture (001): ``dp`` groups of devices each hold one model-parallel copy
of the network, and the copies average their gradients as data parallelism does. The ranks
form a ``dp × mp`` grid (:mod:`lightning_par.hybrid.grid`, picotron's layout: one reshape of
``arange(world)``, model-parallel ranks consecutive), and this strategy is a thin adapter
that adds the data-parallel dimension to an existing model-parallel strategy:

* **model parallel** (``mp_kind``): the pipeline of
  :class:`~lightning_par.strategies.gpipe.GPipeStrategy` (``"gpipe"``: micro-batches, GPipe
  or 1F1B), of :class:`~lightning_par.strategies.layerwise.LayerwiseStrategy`
  (``"layerwise"``: the naive split, or the stacked-RNN wavefront with ``time_chunk``), or
  the layers cut by :class:`~lightning_par.strategies.tensor_parallel.TensorParallelStrategy`
  (``"tensor_parallel"``), run unchanged on the ranks of one row of the grid (their
  ``stage_comm`` / ``tp_comm``);
* **data parallel**: each stage's gradients are averaged over its column of the grid (the
  ranks holding the same layers) by this project's allreduce (``dp_algorithm``, default the
  ring), in buckets that start while backward still runs
  (:mod:`lightning_par.comm.buckets`, as ``ring_allreduce`` does). A pipeline leaves a
  gradient complete only after the step's last micro-batch, so buckets may start from then
  on (Megatron-LM's overlap of the data-parallel reduction with the pipeline flush;
  Narayanan et al., 2021); under 1F1B all of them start after backward; tensor-parallel
  gradients are complete when autograd writes them;
* **data**: sharded by the data-parallel rank only (the ``dp`` replicas read different
  samples; the ``mp`` ranks of a replica read the same batch, as the pipeline needs).

Starting weights are global rank 0's (sent along its replica's stages, then down each
column); checkpoints hold the full model gathered on rank 0 (replica 0) and load without the
strategy. After ``k`` steps every replica holds the weights one process reaches on the
global batch (``dp`` × the per-rank batch).

``HybridStrategy(mp_kind=...)`` returns an object of the class for that kind
(:class:`HybridGPipeStrategy`, ...), which is also a :class:`HybridStrategy`; the kind's own
options (``chunks``, ``balance``, ``time_chunk``, ...) pass through.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_par.collectives import ALGORITHMS, get_allreduce, tree_broadcast
from lightning_par.comm import Communicator, Event
from lightning_par.comm.buckets import GradientBuckets, allreduce_buckets, average_unbucketed
from lightning_par.hybrid.grid import (
    Grid,
    GridGroups,
    check_degrees,
    create_groups,
    groups_across_nodes,
    make_grid,
)
from lightning_par.pipeline.runtime import PipelineStage
from lightning_par.strategies._base import ParStrategy
from lightning_par.strategies.gpipe import GPipeStrategy
from lightning_par.strategies.layerwise import LayerwiseStrategy
from lightning_par.strategies.tensor_parallel import TensorParallelStrategy

DEFAULT_KIND = "gpipe"


class HybridStrategy(ParStrategy):
    """Data parallelism over ``dp`` replicas, each split ``mp`` ways by ``mp_kind``.

    Args:
        dp: data-parallel degree (replicas); ``None`` derives it (world size / ``mp``).
        mp: model-parallel degree (pipeline stages per replica); ``None`` derives it from
            ``dp``, or is 2 when neither is given (``devices=4``: a 2 × 2 grid).
        mp_kind: ``"gpipe"`` (default), ``"layerwise"`` or ``"tensor_parallel"`` (see
            :func:`mp_kinds`).
        dp_algorithm: the allreduce that averages each stage's gradients over its
            data-parallel group, a key of :data:`lightning_par.collectives.ALGORITHMS`
            (default ``"ring"``).
        bucket_cap_mb: gradient bucket size in MiB.
        overlap: start buckets while backward runs (``False``: all after backward).
        **kwargs: the options of the ``mp_kind`` strategy (e.g. ``chunks``, ``schedule``,
            ``balance`` for gpipe; ``time_chunk`` for layerwise; ``plan`` and ``algorithm``
            for tensor_parallel) and ``trace``,
            ``trace_dir``, ``start_method``, ``process_group_backend``, ``timeout``.
    """

    strategy_name = "hybrid"
    shards_data = True  # by the data-parallel rank (distributed_sampler_kwargs)
    mp_kind = ""

    def __new__(cls, **kwargs: Any) -> HybridStrategy:
        target = (
            _strategy_class(kwargs.get("mp_kind", DEFAULT_KIND)) if cls is HybridStrategy else cls
        )
        return super().__new__(target)

    def __init__(
        self,
        *,
        dp: int | None = None,
        mp: int | None = None,
        mp_kind: str = DEFAULT_KIND,
        dp_algorithm: str = "ring",
        bucket_cap_mb: float = 4.0,
        overlap: bool = True,
        **kwargs: Any,
    ) -> None:
        if mp_kind != self.mp_kind:
            raise ValueError(
                f"{type(self).__name__} is the mp_kind={self.mp_kind!r} strategy, got "
                f"mp_kind={mp_kind!r}: use HybridStrategy(mp_kind=...)"
            )
        check_degrees(dp, mp)
        if dp_algorithm not in ALGORITHMS:
            raise ValueError(
                f"hybrid: dp_algorithm={dp_algorithm!r}: choose one of {sorted(ALGORITHMS)}"
            )
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
            raise TypeError(f"bucket_cap_mb must be a number of MiB, got {bucket_cap_mb!r}")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0 MiB, got {bucket_cap_mb}")
        super().__init__(**kwargs)
        self.dp, self.mp, self.dp_algorithm = dp, mp, dp_algorithm
        self._allreduce = get_allreduce(dp_algorithm)
        self._bucket_cap_mb, self._overlap = float(bucket_cap_mb), overlap
        self.groups: GridGroups | None = None
        self._groups_world: object = None
        self.mp_comm: Communicator | None = None
        self.dp_comm: Communicator | None = None
        self.buckets: GradientBuckets | None = None
        self._warned_nodes = False

    # ---- the grid ---------------------------------------------------------------------------
    @property
    def grid(self) -> Grid:
        """The ``dp × mp`` grid of this run's processes (raises for a bad grid)."""
        return make_grid(self.num_processes * self.num_nodes, self.dp, self.mp)

    @property
    def dp_rank(self) -> int:
        return self.grid.dp_rank(self.global_rank)

    @property
    def num_stages(self) -> int:  # the pipeline kinds' stages: one row
        return self.grid.mp

    @property
    def stage_comm(self) -> Communicator | None:
        return self.mp_comm

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        grid = self.grid
        return {"num_replicas": grid.dp, "rank": grid.dp_rank(self.global_rank)}

    def check_before_launch(self, trainer: pl.Trainer | None = None) -> None:
        grid = self.grid  # (a bad grid raises here, before any process starts)
        reason = groups_across_nodes(grid, self.num_processes) if self.num_nodes > 1 else None
        if reason is not None and not self._warned_nodes:
            self._warned_nodes = True
            rank_zero_warn(reason)
        super().check_before_launch(trainer)

    def _connect(self) -> None:
        """This rank's groups (made once per process group) and their communicators."""
        if self.groups is None or self._groups_world is not dist.group.WORLD:
            self.groups = create_groups(self.grid, self.global_rank, self._timeout)
            self._groups_world = dist.group.WORLD
            rank_zero_info(f"hybrid: {self.grid.describe()}, model parallel by {self.mp_kind}")
        self.mp_comm = Communicator(self.groups.mp_group, trace=self.trace)
        self.dp_comm = Communicator(self.groups.dp_group, trace=self.trace)

    # ---- setting up ---------------------------------------------------------------------------
    def prepare_model(self, trainer: pl.Trainer) -> None:
        self._connect()
        super().prepare_model(trainer)  # the mp strategy splits the network on its row

    def sync_model_states(self) -> None:
        """Replica 0's weights (rank 0's, spread along its row by the split) down each column."""
        super().sync_model_states()
        assert self.model is not None and self.dp_comm is not None
        with torch.no_grad():
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                tree_broadcast(tensor.data, comm=self.dp_comm, root=0)

    def configure_sync(self) -> None:
        super().configure_sync()
        assert self.model is not None and self.dp_comm is not None
        self.buckets = allreduce_buckets(
            self.model, self._allreduce, self.dp_comm, bucket_cap_mb=self._bucket_cap_mb,
            overlap=self._overlap, trace=self.trace,
        )  # fmt: skip
        runtime = self._micro_batched_runtime()
        if runtime is not None:
            runtime.before_last_backward = self._release_buckets

    def _micro_batched_runtime(self) -> PipelineStage | None:
        """The pipeline stage whose micro-batches leave gradients partial until the last one
        (``None``: gradients are complete as soon as autograd writes them)."""
        return None

    def _early_buckets_exact(self) -> bool:
        """Whether a bucket started during the last micro-batch's backward holds the whole
        gradient (1F1B hands its gradients over only after backward)."""
        return True

    # ---- a step ---------------------------------------------------------------------------
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.buckets is not None and self._micro_batched_runtime() is not None:
            # GradientBuckets reads `overlap` at every gradient hook: none may start a bucket
            # before the step's last micro-batch (see _release_buckets)
            self.buckets.overlap = False
        return super().training_step(*args, **kwargs)

    def _release_buckets(self) -> None:
        if self.buckets is not None and self._early_buckets_exact():
            self.buckets.overlap = self._overlap

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: no data-parallel communication on accumulating steps."""
        if self.buckets is None:
            yield
            return
        with self.buckets.no_sync():
            yield

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any):
        start = self.trace.now() if self.trace is not None else 0.0
        closure_loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        self._average_gradients(start)  # after the model-parallel backward has finished
        return closure_loss

    def _average_gradients(self, start: float) -> None:
        if self.buckets is None or not self.buckets.enabled:
            return
        if self.trace is None:
            self.buckets.synchronize()
        else:
            self.trace.events.append(Event(self.global_rank, "backward", start, self.trace.now()))
            with self.trace.span("wait for buckets"):
                self.buckets.synchronize()
        self._average_late_parameters()

    def _average_late_parameters(self) -> None:
        """Parameters trainable only since setup have gradients but no bucket: average them
        over the replicas (as ``ring_allreduce`` does)."""
        assert self.model is not None and self.buckets is not None and self.dp_comm is not None
        average_unbucketed(self.buckets.unbucketed(self.model), self._allreduce, self.dp_comm)

    # ---- checkpoints: replica 0 gathers the full model ------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.groups is not None and self.dp_rank != 0:
            return self.lightning_module.state_dict()  # another replica's copy: not gathered
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self.groups is not None and self.dp_rank != 0:
            return {}
        return super().optimizer_state(optimizer)

    @classmethod
    def compare_bytes_per_step(
        cls, model: pl.LightningModule, devices: int, global_batch: int, options: dict
    ) -> list[int]:
        """Bytes per rank and step (:mod:`lightning_par.compare`'s hook), for the pipelined
        kinds (:func:`lightning_par.hybrid.cost.hybrid_bytes_per_step`)."""
        from lightning_par.hybrid.cost import hybrid_bytes_per_step

        kind = options.get("mp_kind", DEFAULT_KIND)
        if kind not in ("gpipe", "layerwise") or options.get("time_chunk") is not None:
            raise ValueError(f"hybrid: no byte model for mp_kind={kind!r} with these options")
        grid = make_grid(devices, options.get("dp"), options.get("mp"))
        return hybrid_bytes_per_step(
            getattr(model, options.get("module_attr", "net")), grid, global_batch,
            dp_algorithm=options.get("dp_algorithm", "ring"),
            bucket_cap_mb=options.get("bucket_cap_mb", 4.0),
        )  # fmt: skip

    def teardown(self) -> None:
        if self.buckets is not None:
            self.buckets.close()
            self.buckets = None
        super().teardown()


class HybridGPipeStrategy(HybridStrategy, GPipeStrategy):
    """:class:`HybridStrategy` whose replicas are GPipe pipelines (``mp_kind="gpipe"``)."""

    mp_kind = "gpipe"

    def _micro_batched_runtime(self) -> PipelineStage | None:
        return self.pipelined.runtime

    def _early_buckets_exact(self) -> bool:
        return self.schedule == "gpipe"


class HybridLayerwiseStrategy(HybridStrategy, LayerwiseStrategy):
    """:class:`HybridStrategy` whose replicas are layer-wise splits (``mp_kind="layerwise"``)."""

    mp_kind = "layerwise"

    def _micro_batched_runtime(self) -> PipelineStage | None:
        return self.pipelined.runtime


class HybridTensorParallelStrategy(HybridStrategy, TensorParallelStrategy):
    """:class:`HybridStrategy` whose replicas are Megatron-style tensor-parallel models
    (``mp_kind="tensor_parallel"``): each layer cut over the ranks of a row, whose ``f``/``g``
    allreduces run inside the row; gradients complete as soon as autograd writes them, so
    buckets start all through backward."""

    mp_kind = "tensor_parallel"

    @property
    def tp_size(self) -> int:
        return self.grid.mp

    @property
    def tp_comm(self) -> Communicator | None:
        return self.mp_comm


_KINDS: dict[str, type[HybridStrategy]] = {
    "gpipe": HybridGPipeStrategy,
    "layerwise": HybridLayerwiseStrategy,
    "tensor_parallel": HybridTensorParallelStrategy,
}


def mp_kinds() -> list[str]:
    """The model-parallel kinds a hybrid grid can run in its rows."""
    return list(_KINDS)


def _strategy_class(kind: object) -> type[HybridStrategy]:
    if kind not in _KINDS:
        raise ValueError(f"hybrid: mp_kind={kind!r}: choose one of {mp_kinds()}")
    return _KINDS[kind]  # type: ignore[index]
