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

The strategy is two components on a grid: the splitter of ``mp_kind``
(:class:`~lightning_par.components.pipeline_split.PipelineSplit`,
:class:`~lightning_par.components.wavefront_split.WavefrontSplit` or
:class:`~lightning_par.components.tensor_split.TensorParallelSplit`, built by
:func:`~lightning_par.components.hybrid_kinds.make_splitter` from the kind's own options:
``chunks``, ``balance``, ``time_chunk``, ``plan``, ...) over each row, and a
:class:`~lightning_par.components.grad_sync.GradientSync` over each column.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_par.collectives import ALGORITHMS, get_allreduce, tree_broadcast
from lightning_par.comm import Communicator
from lightning_par.comm.buckets import GradientBuckets
from lightning_par.components.grad_sync import GradientSync
from lightning_par.components.hybrid_kinds import (  # noqa: F401  (mp_kinds: this module's API)
    DEFAULT_KIND,
    KIND_OPTIONS,
    make_splitter,
    mp_kinds,
)
from lightning_par.components.strategy_options import option_names
from lightning_par.hybrid.grid import (
    Grid,
    GridGroups,
    check_degrees,
    create_groups,
    groups_across_nodes,
    make_grid,
)
from lightning_par.strategies._base import ParStrategy
from lightning_par.strategies._split_context import StrategyContext


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
        **kwargs: ``trace``, ``trace_dir``, ``start_method``, ``process_group_backend``,
            ``timeout``, ``dead_peer_timeout`` (see
            :class:`~lightning_par.strategies._base.ParStrategy`).

    The options of the ``mp_kind`` strategy are keywords of this one too (``None``: the
    kind's default; an option of another kind is refused by name): ``balance``,
    ``chunks``, ``checkpoint``, ``schedule``, ``module_attr``, ``loss_attr``,
    ``balance_by``, ``deferred_batch_norm``, ``time_chunk``, ``virtual_stages``,
    ``split_points``, ``plan``, ``algorithm``, ``loss_fn``, ``target_index`` (gpipe:
    ``chunks``, ``schedule``, ``loss_fn``, ...; layerwise: ``balance``, ``time_chunk``, ...;
    tensor_parallel: ``plan``, ``algorithm``, ``module_attr``).
    """

    strategy_name = "hybrid"
    shards_data = True  # by the data-parallel rank (distributed_sampler_kwargs)

    def __init__(
        self,
        *,
        dp: int | None = None,
        mp: int | None = None,
        mp_kind: str = DEFAULT_KIND,
        dp_algorithm: str = "ring",
        bucket_cap_mb: float = 4.0,
        overlap: bool = True,
        balance: list[int] | None = None,
        chunks: int | None = None,
        checkpoint: str | None = None,
        schedule: str | None = None,
        module_attr: str | None = None,
        loss_attr: str | None = None,
        balance_by: str | None = None,
        deferred_batch_norm: bool | None = None,
        time_chunk: int | None = None,
        virtual_stages: int | None = None,
        split_points: list[str] | None = None,
        plan: dict[str, str] | None = None,
        algorithm: str | None = None,
        loss_fn: Callable[..., Any] | None = None,
        target_index: int | str | None = None,
        **kwargs: Any,
    ) -> None:
        given = {k: v for k, v in locals().items() if k in KIND_OPTIONS and v is not None}
        own = set(option_names(ParStrategy))  # (Lightning's plumbing arguments too)
        # Python callers may pass a kind's option not declared above: the splitter checks it
        given |= {k: kwargs.pop(k) for k in list(kwargs) if k not in own}
        split = make_splitter(mp_kind, given)
        check_degrees(dp, mp)
        if dp_algorithm not in ALGORITHMS:
            raise ValueError(
                f"hybrid: dp_algorithm={dp_algorithm!r}: choose one of {sorted(ALGORITHMS)}"
            )
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
            raise TypeError(f"bucket_cap_mb must be a number of MiB, got {bucket_cap_mb!r}")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0 MiB, got {bucket_cap_mb}")
        super().__init__(**kwargs)  # by name, so that jsonargparse shows ParStrategy's options
        self.mp_kind = mp_kind
        self.splitter = split
        split.bind(StrategyContext(self))
        self.dp, self.mp, self.dp_algorithm = dp, mp, dp_algorithm
        self._overlap = overlap
        self.grad_sync = GradientSync(
            get_allreduce(dp_algorithm), bucket_cap_mb, overlap, rebuild_for_late=False,
            skip_one_rank=False,
        )  # fmt: skip
        self.groups: GridGroups | None = None
        self._groups_world: object = None
        self.mp_comm: Communicator | None = None
        self.dp_comm: Communicator | None = None
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
    def num_stages(self) -> int:
        """Pieces of one replica: one row of the grid."""
        return self.grid.mp

    @property
    @override
    def split_comm(self) -> Communicator | None:
        return self.mp_comm

    @property
    @override
    def split_size(self) -> int:
        return self.grid.mp

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        grid = self.grid
        return {"num_replicas": grid.dp, "rank": grid.dp_rank(self.global_rank)}

    @override
    def check_before_launch(self, trainer: pl.Trainer | None = None) -> None:
        self.grid  # noqa: B018  (a bad grid raises here, before any process starts)
        self._warn_across_nodes()
        super().check_before_launch(trainer)

    def _warn_across_nodes(self) -> None:
        """Once: model-parallel groups that span nodes (mp should stay within a node)."""
        grid = self.grid
        reason = groups_across_nodes(grid, self.num_processes) if self.num_nodes > 1 else None
        if reason is not None and not self._warned_nodes:
            self._warned_nodes = True
            rank_zero_warn(reason)

    def _connect(self) -> None:
        """This rank's groups (made once per process group) and their communicators."""
        if self.groups is None or self._groups_world is not dist.group.WORLD:
            self.groups = create_groups(self.grid, self.global_rank, self.timeout)
            self._groups_world = dist.group.WORLD
            self._warn_across_nodes()  # also where the cluster started the ranks (srun)
            rank_zero_info(f"hybrid: {self.grid.describe()}, model parallel by {self.mp_kind}")
        self.mp_comm = Communicator(self.groups.mp_group, trace=self.trace)
        self.dp_comm = Communicator(self.groups.dp_group, trace=self.trace)

    # ---- setting up ---------------------------------------------------------------------------
    @override
    def prepare_model(self, trainer: pl.Trainer) -> None:
        self._connect()
        super().prepare_model(trainer)  # the splitter cuts the network on its row

    @override
    def sync_model_states(self) -> None:
        """Replica 0's weights (rank 0's, spread along its row by the split) down each column."""
        assert self.model is not None and self.dp_comm is not None
        with torch.no_grad():
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                tree_broadcast(tensor.data, comm=self.dp_comm, root=0)

    @override
    def configure_sync(self) -> None:
        assert self.model is not None and self.dp_comm is not None
        self.grad_sync.attach(self.model, self.dp_comm, self.trace)
        runtime = self.splitter.micro_batched_runtime()
        if runtime is not None:
            runtime.before_last_backward = self._release_buckets

    @override
    def gradient_buckets(self) -> GradientBuckets | None:
        return self.grad_sync.buckets

    # ---- a step ---------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        buckets = self.grad_sync.buckets
        if buckets is not None and self.splitter.micro_batched_runtime() is not None:
            # GradientBuckets reads `overlap` at every gradient hook: none may start a bucket
            # before the step's last micro-batch (see _release_buckets)
            buckets.overlap = False
        return super().training_step(*args, **kwargs)

    def _release_buckets(self) -> None:
        buckets = self.grad_sync.buckets
        if buckets is not None and self.splitter.early_buckets_exact():
            buckets.overlap = self._overlap

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any):
        self.grad_sync.backward_started()
        closure_loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        self.grad_sync.finish(self.global_rank)  # after the model-parallel backward
        return closure_loss

    # ---- checkpoints: replica 0 gathers the full model ------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.groups is not None and self.dp_rank != 0:
            return self.lightning_module.state_dict()  # another replica's copy: not gathered
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self.groups is not None and self.dp_rank != 0:
            return {}
        return super().optimizer_state(optimizer)

    @override
    def teardown(self) -> None:
        self.grad_sync.close()
        super().teardown()
