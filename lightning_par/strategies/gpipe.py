"""GPipe pipeline parallelism as a Lightning strategy: one process per stage.

The network ``module.<module_attr>`` (an ``nn.Sequential``) is cut into ``K = devices``
stages; each process keeps one stage and the batch is fed through as ``chunks``
micro-batches (Huang et al., 2019). The algorithm lives in :mod:`lightning_par.pipeline`;
this file only plugs it into Lightning's hooks.

Contract with the LightningModule (the models in :mod:`lightning_par.models` satisfy it):

* ``module.net`` (``module_attr``) is an ``nn.Sequential`` whose elements each map one
  tensor to one tensor, with no batch-coupled layers (BatchNorm statistics would be per
  micro-batch; use GroupNorm);
* the loss depends on the parameters only through ``self.net(x)``, called once per step
  with the whole batch; everything after it (loss, metrics, logging) runs unchanged on
  every rank with the real output, which the last stage sends to all stages;
* for ``schedule="1f1b"`` the batch is ``(x, y, ...)`` and ``module.criterion``
  (``loss_attr``) is a mean-reduced loss of ``(output, y)``: 1F1B needs the loss per
  micro-batch, and a mean loss is the size-weighted sum of micro-batch losses.

All stages read the same batches (no distributed sampler). Checkpoints hold the full model
gathered on rank 0 and load without this strategy (``CifarCNN.load_from_checkpoint``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn

from lightning_par.comm import CommTrace, Communicator, default_timeout
from lightning_par.comm.launch import choose_start_method, one_thread_after_fork
from lightning_par.pipeline.partition import split_sequential
from lightning_par.pipeline.sequential import PipelinedSequential
from lightning_par.pipeline.state import (
    gather_full_state_dict,
    gather_optimizer_state,
    send_weights_from_first,
    stage_optimizer_state,
)
from lightning_par.strategies import _gpipe_checks as checks
from lightning_par.strategies._launcher import FullStateLauncher


class GPipeStrategy(ParallelStrategy):
    """Pipeline parallelism with micro-batches and re-materialisation (GPipe).

    Args:
        balance: layers per stage (``len(balance)`` = number of devices); ``None`` balances
            automatically (``balance_by``).
        chunks: micro-batches per batch, ``M``; ``1`` is the naive layer-per-device split.
        checkpoint: re-materialisation, ``"never"``, ``"except_last"`` or ``"always"``.
        schedule: ``"gpipe"`` (all forwards, then all backwards) or ``"1f1b"``.
        module_attr: name of the ``nn.Sequential`` attribute of the LightningModule.
        loss_attr: name of its mean-reduced loss module (used by ``"1f1b"`` only).
        balance_by: automatic balance by ``"params"`` (parameter count) or ``"time"``
            (forward + backward time per layer on ``module.example_input_array``).
        trace_dir: if set, each rank writes its message and compute trace there as JSON
            (``rank<N>.json``) at the end, for timelines (:mod:`lightning_par.pipeline.timeline`).
        start_method: ``"fork"``, ``"spawn"``, ``"popen"``...; default from
            :func:`lightning_par.comm.choose_start_method`.
    """

    strategy_name = "gpipe"

    def __init__(
        self,
        balance: list[int] | None = None,
        chunks: int = 4,
        checkpoint: str = "except_last",
        schedule: str = "gpipe",
        module_attr: str = "net",
        loss_attr: str = "criterion",
        balance_by: str = "params",
        trace_dir: str | None = None,
        start_method: str | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        accelerator=None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        checks.check_settings(balance, chunks, checkpoint, schedule, balance_by)
        self.balance, self.chunks, self.checkpoint = balance, chunks, checkpoint
        self.schedule, self.module_attr, self.loss_attr = schedule, module_attr, loss_attr
        self.balance_by, self.trace_dir = balance_by, trace_dir
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        self._timeout = timeout or default_timeout()
        self.comm: Communicator | None = None
        self.num_nodes = 1

    # ---- processes and devices ------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}  # every stage reads every sample

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            return
        device_type = self.parallel_devices[0].type if self.parallel_devices else "cpu"
        method = self._start_method or choose_start_method(device_type, self.num_processes)
        if method == "popen":
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            self._launcher = FullStateLauncher(self, start_method=method)

    def setup_environment(self) -> None:
        super().setup_environment()
        launcher = self._launcher
        if isinstance(launcher, FullStateLauncher) and launcher._start_method == "fork":
            one_thread_after_fork()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or (
            _get_default_process_group_backend_for_device(self.root_device)
        )
        checks.check_backend(self.schedule, self._process_group_backend)
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout
        )

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            rank = self.node_rank * self.num_processes + self.local_rank
            self.cluster_environment.set_global_rank(rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    # ---- splitting the network --------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        checks.check_trainer(trainer, self.schedule, self.precision_plugin)
        self._split_network()
        super().setup(trainer)

    @property
    def pipelined(self) -> PipelinedSequential:
        net = getattr(self.lightning_module, self.module_attr, None)
        assert isinstance(net, PipelinedSequential), "the network has not been split yet"
        return net

    def _split_network(self) -> None:
        module = self.lightning_module
        net = getattr(module, self.module_attr, None)
        if isinstance(net, PipelinedSequential):
            return
        self.check_before_launch(self.lightning_module.trainer)
        balance = checks.resolve_balance(
            module, net, stages=self.world_size, balance=self.balance, balance_by=self.balance_by,
            rank=self.global_rank, broadcast=self.broadcast,
        )  # fmt: skip
        self.comm = Communicator(trace=CommTrace(self.global_rank) if self.trace_dir else None)
        stages = split_sequential(net, balance)
        piped = PipelinedSequential(
            net, balance, self.comm, chunks=self.chunks, checkpoint=self.checkpoint,
            schedule=self.schedule,
        )  # fmt: skip
        piped.to(self.root_device)
        first = [s.state_dict() for s in stages] if self.global_rank == 0 else None
        send_weights_from_first(self.comm, first, piped.state_dict(), self.root_device)
        setattr(module, self.module_attr, piped)

    def check_before_launch(self, trainer: pl.Trainer | None = None) -> None:
        """Reject a network, balance or loss this strategy cannot run, before any process
        starts (the launcher calls this in the main process)."""
        checks.check_before_launch(
            self.lightning_module, trainer, module_attr=self.module_attr,
            stages=self.num_processes * self.num_nodes, balance=self.balance,
            balance_by=self.balance_by, schedule=self.schedule, loss_attr=self.loss_attr,
            devices=self.parallel_devices or [], backend=self._process_group_backend,
        )  # fmt: skip

    # ---- steps ------------------------------------------------------------------------------
    def _in_step(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        net = self.pipelined
        net.active = True
        try:
            return getattr(super(), hook)(*args, **kwargs)
        finally:
            net.active = False

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        x = batch if isinstance(batch, torch.Tensor) else batch[0]
        if x.shape[0] < self.chunks:
            if self.lightning_module.trainer.global_step == 0:
                raise ValueError(
                    f"chunks={self.chunks} micro-batches but the batch has {x.shape[0]} samples: "
                    f"use chunks <= batch size"
                )
            rank_zero_warn(f"a batch of {x.shape[0]} < chunks={self.chunks} samples runs as "
                           f"{x.shape[0]} micro-batches")  # fmt: skip
        if self.schedule == "1f1b":
            if isinstance(batch, torch.Tensor) or len(batch) < 2:
                raise TypeError("schedule='1f1b' needs batches of the form (input, target, ...)")
            scale = 1.0 / self.lightning_module.trainer.accumulate_grad_batches
            loss_fn = getattr(self.lightning_module, self.loss_attr)
            with self.precision_plugin.train_step_context():
                self.pipelined.train_1f1b(x, batch[1], loss_fn, scale)
        return self._in_step("training_step", *args, **kwargs)

    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any):
        closure_loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        self.pipelined.backward()  # GPipe's backward half (1F1B already ran its backwards)
        return closure_loss

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._in_step("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._in_step("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._in_step("predict_step", *args, **kwargs)

    # ---- collectives Lightning needs (logging with sync_dist, barriers) -----------------------
    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor, group: Any | None = None, reduce_op: Any | None = "mean"):
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ---- checkpoints: the full model on rank 0 -----------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full model's state dict on rank 0 (every stage's layers, original names)."""
        local = self.lightning_module.state_dict()
        return gather_full_state_dict(self.comm, local, f"{self.module_attr}.", self.root_device)

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        state = super().optimizer_state(optimizer)
        return gather_optimizer_state(self.comm, state, self.root_device)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(stage_optimizer_state(state, self.global_rank))

    def teardown(self) -> None:
        if self.trace_dir and self.comm is not None and self.comm.trace is not None:
            Path(self.trace_dir).mkdir(parents=True, exist_ok=True)
            trace = self.comm.trace
            record = {
                "rank": trace.rank,
                "origin": trace.origin,
                "messages": trace.to_records(),
                "events": [vars(e) for e in trace.events],
            }
            (Path(self.trace_dir) / f"rank{self.global_rank}.json").write_text(json.dumps(record))
        super().teardown()
