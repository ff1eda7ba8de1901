"""The base every lightning_par strategy inherits: launching, process group, trace.

:class:`ParStrategy` keeps the plumbing of Lightning's ``DDPStrategy`` (ranks, devices,
``barrier``/``broadcast``/``reduce``, samplers, checkpoint I/O) and replaces what every
plugin needs done its own way:

* **launching** by the project's launch policy at ``fit`` time, nothing launched when the
  ranks exist already (torchrun, SLURM, ``run_on_ranks``: :func:`._launchers.make_launcher`);
* **the process group** met in a store no other job can take, a dead peer reported within
  seconds (:mod:`~lightning_par.components.process_group`), one line for the whole run;
* **one trace option**: ``trace=True`` records every message and compute span in
  :attr:`trace` (a :class:`~lightning_par.comm.CommTrace`), ``trace_dir=...`` also saves
  each rank's as ``rank<N>.json`` (:func:`lightning_par.comm.trace.load_traces`);
* **no DistributedDataParallel wrapper**: :meth:`setup` calls hooks the plugins fill in.

Hooks, in ``Trainer.fit`` order: ``launcher.launch`` → ``check_before_launch`` (main
process) → ranks start → ``setup_environment`` (process group) → ``setup``:
:meth:`prepare_model`, ``model_to_device``, :meth:`sync_model_states`, when fitting
:meth:`configure_sync` and the optimisers → the loop → ``teardown`` (trace written).
The pieces live in components: :mod:`~lightning_par.components.process_group`,
:mod:`~lightning_par.components.strategy_options` and the model splitter
(:mod:`~lightning_par.components.splitter`; the default one holds the whole model), which
the four ``*_step`` hooks, ``backward``, the optimiser step and the checkpoint hooks below
hand the model to; a fork launch's whole checkpoint goes back to the script through
:mod:`._carry_back`.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_par import _compat
from lightning_par.comm import CommTrace, Communicator
from lightning_par.comm.buckets import GradientBuckets
from lightning_par.comm.trace import save_trace
from lightning_par.components.checkpoint_check import check_checkpoint
from lightning_par.components.process_group import join_process_group, strategy_store
from lightning_par.components.splitter import ModelSplitter
from lightning_par.components.strategy_options import check_options, plumbing_arguments
from lightning_par.launch import default_timeout, liveness
from lightning_par.launch.faults import Fault, planned_faults, strike_due
from lightning_par.launch.policy import LaunchPlan
from lightning_par.launch.rendezvous import StoreAddress
from lightning_par.strategies._carry_back import dump_for_script, with_training_state
from lightning_par.strategies._launchers import log_startup, make_launcher


class ParStrategy(DDPStrategy):
    """Shared plumbing of the lightning_par strategies (see the module docstring).

    Args:
        trace: record messages and compute spans in :attr:`trace`.
        trace_dir: also save each rank's trace there as ``rank<N>.json``.
        start_method: ``"fork"``, ``"popen"``, ``"spawn"`` or ``"forkserver"``; default
            :func:`lightning_par.comm.plan_launch`, decided at launch time.
        process_group_backend: ``"gloo"`` or ``"nccl"`` (default: by device).
        timeout: how long a collective or receive may wait before the run fails, naming
            the rank (default :func:`~lightning_par.comm.default_timeout`).
        dead_peer_timeout: seconds a rank may stop responding (frozen, its machine or
            network gone) before the job ends, naming it (default
            :data:`~lightning_par.launch.rendezvous.DEAD_PEER_S`, 60 s, or
            ``LIGHTNING_PAR_DEAD_PEER_S``; at most ``timeout``). A slow step does not count:
            each rank beats from a thread of its own (:mod:`lightning_par.launch.liveness`).
    """

    #: The name this class is registered under (set by the registry table).
    strategy_name: ClassVar[str] = "lightning_par"
    #: Data-parallel strategies give each rank its own shard of the training data (Lightning
    #: injects a ``DistributedSampler``); model-split ones feed every rank the same batches,
    #: from the user's own sampler, as one process would read them.
    shards_data: ClassVar[bool] = True

    def __init__(
        self,
        *,
        trace: bool = False,
        trace_dir: str | os.PathLike | None = None,
        start_method: str | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        dead_peer_timeout: float | None = None,
        **unknown: Any,
    ) -> None:
        # ``unknown`` is never forwarded with ``**``: jsonargparse (the CLI) follows such a
        # forward into DDPStrategy's signature and would offer every torch DDP option.
        # Lightning's connector-set arguments (PLUMBING_ARGUMENTS) are picked out by name.
        check_options(type(self), unknown, start_method, trace, dead_peer_timeout)
        super().__init__(
            process_group_backend=process_group_backend,
            timeout=timeout or default_timeout(),
            start_method=start_method or "popen",
            **plumbing_arguments(unknown),
        )
        self._requested_start_method = start_method
        self.dead_peer_timeout = dead_peer_timeout
        #: the faults ``LIGHTNING_PAR_FAULT`` plans (:mod:`lightning_par.launch.faults`)
        self.faults: list[Fault] = planned_faults()
        self._trace_enabled = trace or trace_dir is not None
        self.trace_dir = Path(trace_dir) if trace_dir is not None else None
        self.trace: CommTrace | None = None
        self.comm: Communicator | None = None
        self.launch_plan: LaunchPlan | None = None
        #: the store this project's launcher holds for the ranks (None: the cluster's)
        self.store_spec: str | None = None
        #: the store the default process group met in (the group's own key prefix)
        self.process_group_store: Any = None
        #: the model-splitting component (pipeline stages, tensor-parallel shards); the
        #: default does nothing: every rank holds the whole model
        self.splitter: ModelSplitter = ModelSplitter()
        #: the arguments of the Trainer method being launched (``ckpt_path``, ...)
        self.launch_arguments: dict[str, Any] = {}
        #: in a rank of a fork launch: the checkpoint dumped at the end of ``fit``, sent to
        #: the script (:mod:`._carry_back`)
        self.end_of_fit_checkpoint: dict[str, Any] | None = None
        #: in the script after a fork launch's ``fit``: rank 0's training state, merged into
        #: the script's checkpoints
        self.training_state: dict[str, Any] | None = None

    # ---- building the model ---------------------------------------------------------------------
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)`` under a strategy whose splitter builds
        stage by stage: the model is built on the meta device, and each device gives storage
        to its own stages only (:mod:`lightning_par.pipeline.materialize`)."""
        meta = empty_init and self.splitter.materializes_meta
        with torch.device("meta") if meta else super().tensor_init_context(empty_init):
            yield

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # a model built on the meta device takes a checkpoint's weights once its stages have
        # storage (before setup they would be copied into nothing)
        module = self.lightning_module
        return module is not None and any(p.is_meta for p in module.parameters())

    # ---- launching --------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        self._launcher = make_launcher(self, self._requested_start_method)

    def describe_failure(self, error: BaseException) -> None:
        """In the rank where ``error`` was raised: rewrite it in place to name the cause a
        plugin knows better than the error does (override; the default changes nothing)."""

    def check_before_launch(self, trainer: pl.Trainer | None) -> None:
        """Reject a configuration this strategy cannot run, in the main process, before
        any rank starts (override and call it; the default checks ``ckpt_path`` and asks
        the splitter)."""
        check_checkpoint(self.launch_arguments.get("ckpt_path"))
        self.splitter.check_before_launch(trainer)

    # ---- process group ------------------------------------------------------------------------
    @override
    def setup_distributed(self) -> None:
        # No reset_seed() (Lightning's DDP calls it): every rank already holds the random
        # state one process would have here (forked, restored by the forkserver, or the
        # same script re-run by popen and torchrun); re-seeding would give dropout and
        # augmentation other draws than one process's
        self.set_world_ranks()
        backend = self._get_process_group_backend()
        _compat.set_process_group_backend(self, backend)
        store = join_process_group(self, backend)
        if store is not None:
            self.process_group_store = store
        log_startup(self.strategy_name, self.world_size, self.launch_plan, backend)

    @property
    def timeout(self) -> timedelta:
        """How long a collective or a receive may wait (the constructor's ``timeout``)."""
        return _compat.strategy_timeout(self)

    def watched_ranks(self) -> list[int]:
        """Ranks whose silence ends the job (:mod:`lightning_par.launch.liveness`): all."""
        return list(range(self.world_size))

    def rank_name(self, rank: int) -> str:
        """How reports name group rank ``rank``."""
        return f"rank {rank}"

    def group_store(self) -> tuple[Any, StoreAddress]:
        """The store the next process group meets in (:func:`.strategy_store`)."""
        return strategy_store(self)

    @override
    def _get_process_group_backend(self) -> str:
        return _compat.process_group_backend(self) or _compat.default_process_group_backend(
            self.root_device
        )

    # ---- setting the model up -------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if not self.shards_data:  # read before the loop sets its data loaders up
            _compat.set_use_distributed_sampler(trainer, False)
        self.splitter.materialize_whole(self.lightning_module)  # as one process builds it
        layer_sync = _compat.layer_sync(self)
        if fitting and layer_sync:
            self.model = layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.trace = CommTrace(self.global_rank) if self._trace_enabled else None
        self.comm = Communicator(trace=self.trace)
        self.prepare_model(trainer)
        self.model_to_device()
        self.sync_model_states()
        if fitting:
            self.configure_sync()
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _compat.optimizers_to_device(self.optimizers, self.root_device)
        self.splitter.after_setup(trainer)
        if self.trace is not None:
            self.trace.clear()  # keep only what training, testing, ... send

    def prepare_model(self, trainer: pl.Trainer) -> None:
        """Change the model before it moves to its device (default: the splitter cuts it)."""
        self.splitter.split(trainer)

    def sync_model_states(self) -> None:
        """Make every rank start from the same weights (data parallel: rank 0's)."""

    def configure_sync(self) -> None:
        """When fitting: set up how gradients or parameters are kept in step."""

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        with self.splitter.optimizer_errors_explained():
            super().setup_optimizers(trainer)

    # ---- the model split over ranks: each hook hands its piece to the splitter ---------------
    @property
    def split_comm(self) -> Communicator | None:
        """The ranks one model is split over (every rank; hybrid: one row of its grid)."""
        return self.comm

    @property
    def split_size(self) -> int:
        """How many pieces one model is cut into (every process; hybrid: its ``mp``)."""
        return self.num_processes * self.num_nodes

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # a model split over the ranks is one replica whose every rank reads the whole batch
        # (as Lightning's ModelParallelStrategy says): a sharded loader reads one process's
        if self.shards_data:
            return super().distributed_sampler_kwargs
        return {"num_replicas": 1, "rank": 0}

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        strike_due(self.faults, self.lightning_module.trainer.global_step, self.global_rank)
        self.splitter.before_training_step(args[0] if args else kwargs.get("batch"))
        with self.splitter.running():
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.splitter.running():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.splitter.running():
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.splitter.running():
            return super().predict_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kw: Any) -> Any:
        self.splitter.before_backward(closure_loss)  # before a GradScaler scales it
        closure_loss = super().backward(closure_loss, optimizer, *args, **kw)
        self.splitter.after_backward()
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kw: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kw)
        self.splitter.after_optimizer_step(optimizer)
        return output

    # ---- checkpoints in one process's format ------------------------------------------------
    @property
    def holds_whole_model(self) -> bool:
        """True in the script's process after a fork launch: no rank was set up here and the
        model holds the whole network, brought back from the ranks."""
        return self.comm is None

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        dump_for_script(self)  # a fork launch: the script gets the whole checkpoint

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        whole = super().lightning_module_state_dict()
        return whole if self.holds_whole_model else self.splitter.full_state_dict(whole)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if self.holds_whole_model:  # the script's checkpoint: rank 0's training state too
            checkpoint = with_training_state(checkpoint, self.training_state)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        state = self.splitter.piece_state_dict(checkpoint["state_dict"])
        super().load_model_state_dict({**checkpoint, "state_dict": state}, strict=strict)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return self.splitter.full_optimizer_state(super().optimizer_state(optimizer), optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self.splitter.load_optimizer_states(self.optimizers, checkpoint["optimizer_states"]):
            super().load_optimizer_state_dict(checkpoint)

    # ---- gradient accumulation ------------------------------------------------------------------
    def gradient_buckets(self) -> GradientBuckets | None:
        """The buckets this strategy's backward communicates through (None: none)."""
        return None

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: no communication on the accumulating micro-steps (the
        buckets' ``no_sync``; without buckets, DDPStrategy's: torch DDP's ``no_sync``)."""
        buckets = self.gradient_buckets()
        with super().block_backward_sync() if buckets is None else buckets.no_sync():
            yield

    # ---- end of a run ---------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        if liveness.current() is not None:
            liveness.current().finish()  # done with this stage: peers stop watching
        if self.trace_dir is not None and self.trace is not None:
            save_trace(self.trace, self.trace_dir / f"rank{self.global_rank}.json")
        super().teardown()
