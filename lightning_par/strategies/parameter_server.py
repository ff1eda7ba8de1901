"""Synchronous sharded parameter server as a Lightning strategy.

Workers are Lightning's training processes (``devices`` x ``num_nodes``); ``num_servers``
extra processes, started by the workers (:mod:`lightning_par.paramserver.process`), hold the
parameters and the optimiser state and apply the updates (course material 003: "store the
model parameters outside of the workers"). The algorithm is in :mod:`lightning_par.paramserver`;
this file plugs it into Lightning:

* ``setup_distributed``: each node's local rank 0 starts its share of the servers
  (:mod:`lightning_par.paramserver.process`), then all ``W + S`` ranks join one gloo
  process group; Lightning's ``barrier``/``broadcast``/``reduce``/``all_gather`` use a
  group of the workers only (:mod:`~lightning_par.components.worker_group`). Under
  popen, torchrun or SLURM nothing changes: launch ``W`` workers as usual. ``teardown``
  ends the servers and the group, so ``fit`` then ``test`` starts fresh ones.
* ``setup``: a :class:`~lightning_par.paramserver.ParameterClient` over the model and the
  user's optimiser (its class and param groups run on the servers);
* the step: backward pushes each gradient bucket as it is filled, ``optimizer_step`` runs
  the closure and the ``on_before_optimizer_step`` hooks but not ``optimizer.step``: the
  servers step; the next forward waits per layer for the pulled weights;
* checkpoints: the full model (every worker has it) and the full optimiser state gathered
  from the servers, in the format of the user's optimiser, so they load without this
  strategy; resuming sends the state back to the servers.

Gradient clipping (by norm: the servers exchange their shards' squared norms) and
``bf16-mixed`` are exact against one process (:mod:`~lightning_par.strategies._ps_features`).
Refused before training: manual optimisation, several optimisers, ``16-mixed`` and true
half precision, a ``configure_gradient_clipping`` override, ``sync_batchnorm``, optimisers
that are not element-wise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from typing_extensions import override

from lightning_par import _compat
from lightning_par.comm import Event, liveness
from lightning_par.components.worker_group import WorkerGroup, check_positive
from lightning_par.paramserver import process as servers
from lightning_par.paramserver.clipping import GradClip
from lightning_par.paramserver.faults import explain
from lightning_par.paramserver.messages import close_untrained
from lightning_par.paramserver.worker import ParameterClient
from lightning_par.strategies._base import ParStrategy
from lightning_par.strategies._late_params import (
    refuse_frozen_in_optimizer,
    refuse_late_parameters,
)
from lightning_par.strategies._launchers import log_startup
from lightning_par.strategies._ps_features import check_features, trainer_clip


class ParameterServerStrategy(ParStrategy):
    """Data parallelism through ``num_servers`` sharded, synchronous parameter servers.

    Args:
        num_servers: server processes ``S``; parameters are spread over them by bytes.
        bucket_cap_mb: gradient bucket (push) size in MiB; small buckets push layer by layer.
        split_mb: tensors larger than this (MiB) are split over all servers.
        **kwargs: ``trace``, ``trace_dir``, ``start_method``, ``timeout`` (see
            :class:`~lightning_par.strategies._base.ParStrategy`). The process group is
            always gloo (servers run on CPU; CUDA tensors are staged through pinned memory).
    """

    strategy_name = "parameter_server"
    #: The worker side (asynchronous SGD subclasses both).
    client_cls: type[ParameterClient] = ParameterClient

    def _server_options(self) -> dict[str, Any]:
        """Keyword arguments for :func:`~lightning_par.paramserver.process.start_servers`."""
        return {}

    def _client_options(self, clip: GradClip | None) -> dict[str, Any]:
        """Keyword arguments for the client: the servers clip the averaged gradient."""
        return {"clip": clip}

    def __init__(
        self,
        num_servers: int = 1,
        bucket_cap_mb: float = 1.0,
        split_mb: float = 1.0,
        **kwargs: Any,
    ) -> None:
        check_positive("num_servers", num_servers, int)
        check_positive("bucket_cap_mb", bucket_cap_mb)
        check_positive("split_mb", split_mb)
        backend = kwargs.pop("process_group_backend", None)
        if backend not in (None, "gloo"):
            raise ValueError(
                f"process_group_backend={backend!r}: the parameter server talks to CPU servers "
                "over gloo (CUDA workers stage through pinned memory); leave it unset"
            )
        super().__init__(process_group_backend="gloo", **kwargs)
        self.num_servers, self.bucket_cap_mb, self.split_mb = num_servers, bucket_cap_mb, split_mb
        self.client: ParameterClient | None = None
        #: Lightning's collectives among the workers only (the servers are in no loop)
        self.workers = WorkerGroup()
        self._servers: list = []
        self._server_watch: Any = None
        #: the servers this process started (each node's local rank 0 starts its share)
        self.started_servers: list[int] = []
        self._failed = False
        self._backward_start = 0.0

    # ---- refusing what we cannot do exactly ---------------------------------------------------
    @override
    def check_before_launch(self, trainer: pl.Trainer | None) -> None:
        check_features(self.strategy_name, self.lightning_module, trainer, _compat.layer_sync(self))

    # ---- processes -----------------------------------------------------------------------------
    @override
    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        if dist.is_initialized():
            raise RuntimeError(
                f"{self.strategy_name} builds its own process group of workers and servers; it "
                "cannot join one that exists. Start W workers (Trainer(devices=W), torchrun "
                "--nproc-per-node W) without initialising torch.distributed first"
            )
        workers = self.world_size
        store, address = self.group_store()
        if self.local_rank == 0:  # each node starts its share of the servers
            mine = servers.servers_of_node(self.num_servers, self.num_nodes, self.node_rank)
            self.started_servers = mine
            self._servers = servers.start_servers(
                mine, workers, self.num_servers, address, self.timeout,
                **self._server_options(),
            )  # fmt: skip
        dist.init_process_group(
            "gloo",
            store=store,
            rank=self.global_rank,
            world_size=workers + self.num_servers,
            timeout=self.timeout,
        )
        self._server_watch = (
            servers.watch_servers(self._servers, workers) if self._servers else None
        )
        liveness.watch_group(
            store, self.global_rank, self.watched_ranks(), self.timeout,
            self.rank_name,
        )  # fmt: skip
        self.workers.create(workers)
        self.workers.prepare_data(self.lightning_module)
        log_startup(
            f"{self.strategy_name} ({self.num_servers} server(s))",
            workers,
            self.launch_plan,
            "gloo",
        )

    # ---- setting up the client -----------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self.check_before_launch(trainer)  # also under torchrun, where no launcher calls it
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        # Lightning broadcasts a SIGTERM flag on the default group every step; servers are in
        # that group but not in the loop, so the flag travels among the workers only.
        _compat.replace_sigterm_broadcast(
            trainer, lambda: self.workers.broadcast_sigterm(trainer, self.global_rank)
        )
        if len(self.optimizers) != 1:
            raise ValueError(
                f"{self.strategy_name} runs one optimiser; configure_optimizers "
                f"returned {len(self.optimizers)}"
            )
        assert self.model is not None and self.comm is not None
        refuse_frozen_in_optimizer(self.model, self.optimizers[0], self.strategy_name)
        self.client = self.client_cls(
            self.model,
            self.optimizers[0],
            self.comm,
            self.world_size,
            self.num_servers,
            bucket_cap_mb=self.bucket_cap_mb,
            split_mb=self.split_mb,
            trace=self.trace,
            name=self.strategy_name,
            **self._client_options(trainer_clip(trainer)),
        )

    # ---- Lightning's collectives: among the workers -------------------------------------------
    @property
    def worker_group(self) -> Any:
        """The workers' process group (ranks ``0 .. W-1``; the servers are not in it)."""
        return self.workers.group

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self.workers.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.workers.broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        return super().reduce(tensor, group=group or self.workers.group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False):
        group = group or self.workers.group
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def sync_model_states(self) -> None:
        assert self.model is not None
        self.workers.sync_model_states(self.model)

    # ---- the step ------------------------------------------------------------------------------
    @override
    def gradient_buckets(self) -> Any:
        """Gradient accumulation: no push on the accumulating micro-steps."""
        return self.client.buckets if self.client is not None else None

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        if self.client is not None:
            self.client.settle()  # any layer the forward did not wait for (unused, reused)
        if self.trace is not None:
            self._backward_start = self.trace.now()

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if self.client is None or not self.client.buckets.enabled:
            return
        if self.trace is None:
            self.client.finish_backward()
            return
        self.trace.events.append(
            Event(self.global_rank, "backward", self._backward_start, self.trace.now())
        )
        with self.trace.span("wait for pushes"):
            self.client.finish_backward()

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any):
        """Forward, backward (which pushed the gradients) and the pre-step hooks; the servers
        step the optimiser, so the worker's ``optimizer.step`` is not called."""
        if self.client is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        result = closure()
        if result is None:
            raise RuntimeError(
                f"{self.strategy_name}: training_step returned None; every worker "
                "must push every step (the servers wait for all of them)"
            )
        module = model if isinstance(model, pl.LightningModule) else self.lightning_module
        _compat.after_closure(self.precision_plugin, module, optimizer)
        _compat.mark_optimizer_stepped(optimizer)  # it did, on the servers: no scheduler warning
        return result

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.client is not None:  # before this step pushes or pulls anything
            refuse_late_parameters(self.lightning_module, self.client.params, self.strategy_name)
        return super().training_step(*args, **kwargs)

    def _settled(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        if self.client is not None:
            self.client.settle()
        return getattr(super(), hook)(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._settled("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._settled("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._settled("predict_step", *args, **kwargs)

    # ---- checkpoints ---------------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.client is not None:
            self.client.settle()
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self.client is None:
            return super().optimizer_state(optimizer)
        return self.client.gather_state()  # complete on worker 0, which writes the file

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self.client is None:
            return super().load_optimizer_state_dict(checkpoint)
        self.client.load_state(checkpoint["optimizer_states"][0])

    # ---- the end -------------------------------------------------------------------------------
    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # no goodbye protocol: peers may be mid-step or gone
        self.describe_failure(exception)
        # under torchrun Lightning calls this in the rank (a fork launch: in the main process)
        if self.client is None or not isinstance(exception, RuntimeError):
            return
        if exception.args and isinstance(exception.args[0], str):  # a server may know who
            exception.args = (explain(exception.args[0]), *exception.args[1:])

    @override
    def watched_ranks(self) -> list[int]:
        return list(range(self.world_size + self.num_servers))

    @override
    def rank_name(self, rank: int) -> str:
        return servers.role_name(self.world_size, rank)

    @override
    def describe_failure(self, error: BaseException) -> None:
        if dist.is_initialized():
            servers.name_dead_server(error, self.global_rank)

    @override
    def teardown(self) -> None:
        trainer = _compat.attached_trainer(self.lightning_module)  # None once detached
        interrupted = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
        clean = not (interrupted or self._failed) and dist.is_initialized()
        if self.client is not None:
            if clean:
                self.client.close()
            self.client = None
        elif clean and self.global_rank == 0 and self.comm is not None:
            close_untrained(self.comm, self.world_size, self.num_servers)
        if self._server_watch is not None:
            self._server_watch.set()  # the servers end now: no longer news
        if self._servers:
            servers.stop_servers(self._servers, wait_s=10.0 if clean else 0.0)
            self._servers = []
        liveness.stop_watching()
        if clean:  # the servers are gone: a later fit/test/validate builds a new group
            dist.destroy_process_group()
        super().teardown()
