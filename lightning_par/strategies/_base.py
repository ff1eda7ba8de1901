"""The base every lightning_par strategy inherits: launching, process group, trace.

:class:`ParStrategy` keeps the plumbing of Lightning's ``DDPStrategy`` (ranks, devices,
``barrier``/``broadcast``/``reduce``, samplers, checkpoint I/O) and replaces what every
plugin needs done its own way:

* **launching** by the project's launch policy at ``fit`` time
  (:class:`~lightning_par.strategies._launchers.PolicyLauncher`), nothing launched when
  the ranks exist already (torchrun, SLURM, ``run_on_ranks``);
* **the process group** met in a store no other job can take
  (:mod:`lightning_par.launch.rendezvous`), waiting up to the ``timeout`` (30 min,
  ``LIGHTNING_PAR_TIMEOUT``) for a live peer while a dead one is reported within seconds
  (:mod:`lightning_par.launch.liveness`), announced by one line for the whole run;
* **one trace option**: ``trace=True`` records every message and compute span in
  :attr:`trace` (a :class:`~lightning_par.comm.CommTrace`; after a fork launch the main
  process receives rank 0's), ``trace_dir=...`` also saves each rank's trace as
  ``rank<N>.json`` (:func:`lightning_par.comm.trace.load_traces` reads them back);
* **no DistributedDataParallel wrapper**: :meth:`setup` calls three hooks that the
  plugins fill in.

How a plugin maps onto Lightning's hooks (``Trainer.fit``): ``launcher.launch`` →
``check_before_launch`` (main process) → ranks start → ``setup_environment`` (process
group) → ``setup``: :meth:`prepare_model` (e.g. split the network), ``model_to_device``,
:meth:`sync_model_states` (every rank starts from rank 0's weights), and when fitting
:meth:`configure_sync` (e.g. gradient buckets) and the optimisers → the loop
(``training_step``, ``backward`` with ``pre_backward``/``post_backward``,
``optimizer_step``) → ``teardown`` (trace written).
"""

from __future__ import annotations

import atexit
import inspect
import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_par import _compat
from lightning_par.comm import CommTrace, Communicator
from lightning_par.comm.buckets import GradientBuckets
from lightning_par.comm.trace import save_trace
from lightning_par.components.splitter import ModelSplitter
from lightning_par.launch import default_timeout, liveness
from lightning_par.launch.policy import START_METHODS, LaunchPlan
from lightning_par.launch.rendezvous import StoreAddress, group_store
from lightning_par.strategies._launchers import (
    ExistingRanksLauncher,
    PolicyLauncher,
    log_startup,
)

#: Arguments Lightning's accelerator connector may pass to any strategy.
PLUMBING_ARGUMENTS = (
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
)


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
        **plumbing: Any,
    ) -> None:
        unknown = sorted(set(plumbing) - set(PLUMBING_ARGUMENTS))
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unknown option(s) {unknown}; it accepts "
                f"{', '.join(self.option_names())} (torch DDP options do not apply: there is "
                "no DistributedDataParallel wrapper)"
            )
        if start_method is not None and start_method not in START_METHODS:
            raise ValueError(f"start_method={start_method!r}: choose one of {START_METHODS}")
        if not isinstance(trace, bool):
            raise TypeError(f"trace must be True or False, got {trace!r}")
        super().__init__(
            process_group_backend=process_group_backend,
            timeout=timeout or default_timeout(),
            start_method=start_method or "popen",
            **plumbing,
        )
        self._requested_start_method = start_method
        self._trace_enabled = trace or trace_dir is not None
        self.trace_dir = Path(trace_dir) if trace_dir is not None else None
        self.trace: CommTrace | None = None
        self.comm: Communicator | None = None
        self.launch_plan: LaunchPlan | None = None
        #: the store this project's launcher holds for the ranks (None: the cluster's)
        self.store_spec: str | None = None
        #: the model-splitting component (pipeline stages, tensor-parallel shards), or None:
        #: every rank holds the whole model
        self.splitter: ModelSplitter | None = None

    @classmethod
    def option_names(cls) -> list[str]:
        """Every keyword this strategy takes (for error messages)."""
        names = []
        for klass in cls.__mro__:
            if klass is DDPStrategy:
                break
            for name, p in inspect.signature(klass.__init__).parameters.items():
                if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD:
                    if name != "self" and name not in names:
                        names.append(name)
        return names + list(PLUMBING_ARGUMENTS)

    # ---- building the model ---------------------------------------------------------------------
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)`` under a strategy whose splitter builds
        stage by stage: the model is built on the meta device, and each device gives storage
        to its own stages only (:mod:`lightning_par.pipeline.materialize`)."""
        if empty_init and self.splitter is not None and self.splitter.materializes_meta:
            with torch.device("meta"):
                yield
            return
        with super().tensor_init_context(empty_init):
            yield

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # a model built on the meta device takes a checkpoint's weights once its stages have
        # storage (before setup they would be copied into nothing)
        module = self.lightning_module
        return module is not None and any(p.is_meta for p in module.parameters())

    # ---- launching --------------------------------------------------------------------------
    @property
    @override
    def root_device_type(self) -> str:
        return self.parallel_devices[0].type if self.parallel_devices else "cpu"

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            self._launcher = ExistingRanksLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            self._launcher = PolicyLauncher(self, requested=self._requested_start_method)

    def describe_failure(self, error: BaseException) -> None:
        """In the rank where ``error`` was raised: rewrite it in place to name the cause a
        plugin knows better than the error does (override; the default changes nothing)."""

    def check_before_launch(self, trainer: pl.Trainer | None) -> None:
        """Reject a configuration this strategy cannot run, in the main process, before
        any rank starts (override; the default asks the splitter, if any)."""
        if self.splitter is not None:
            self.splitter.check_before_launch(trainer)

    # ---- process group ------------------------------------------------------------------------
    @override
    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        backend = self._get_process_group_backend()
        _compat.set_process_group_backend(self, backend)
        env = self.cluster_environment
        assert env is not None
        if not dist.is_initialized():
            os.environ["MASTER_ADDR"] = env.main_address
            os.environ["MASTER_PORT"] = str(env.main_port)
            store, _ = self.group_store()
            kwargs: dict[str, Any] = {"timeout": self.timeout, "store": store}
            if self.root_device.type != "cpu":
                kwargs["device_id"] = self.root_device
            dist.init_process_group(
                backend, rank=self.global_rank,
                world_size=self.world_size, **kwargs,
            )  # fmt: skip
            # Destroy the group before the interpreter's own shutdown: a gloo group still
            # alive then can abort the process ("terminate called without an active
            # exception"), as Lightning already guards against for NCCL.
            atexit.register(_destroy_process_group)
            liveness.watch_group(
                store, self.global_rank, self.watched_ranks(), self.timeout,
                self.rank_name,
            )  # fmt: skip
        elif liveness.current() is not None:
            liveness.current().resume()  # fit, then test: the same group, watched again
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
        """The store the next process group meets in (see :mod:`lightning_par.launch.rendezvous`):
        the one this project's launcher holds, else the cluster's (``srun`` sets no
        ``MASTER_PORT``: Lightning's ``SLURMEnvironment`` derives it from the job id)."""
        env = self.cluster_environment
        main = None if env is None else (env.main_address, env.main_port)
        return group_store(self.global_rank, self.timeout, self.store_spec, main)

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
        if self.splitter is not None:
            self.splitter.after_setup(trainer)
        if self.trace is not None:
            self.trace.clear()  # keep only what training, testing, ... send

    def prepare_model(self, trainer: pl.Trainer) -> None:
        """Change the model before it moves to its device (default: the splitter cuts it)."""
        if self.splitter is not None:
            self.splitter.split(trainer)

    def sync_model_states(self) -> None:
        """Make every rank start from the same weights (data parallel: rank 0's)."""

    def configure_sync(self) -> None:
        """When fitting: set up how gradients or parameters are kept in step."""

    @override
    def configure_ddp(self) -> None:  # DDPStrategy's hook: no DistributedDataParallel here
        self.configure_sync()

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        try:
            super().setup_optimizers(trainer)
        except ValueError as err:
            better = self.splitter.explain_optimizer_error(err) if self.splitter else None
            if better is None:
                raise
            raise better from err

    # ---- the model split over ranks (the splitter) ----------------------------------------------
    @property
    def split_comm(self) -> Communicator | None:
        """The ranks one model is split over (every rank; hybrid: one row of its grid)."""
        return self.comm

    @property
    def split_size(self) -> int:
        """How many pieces one model is cut into (every process; hybrid: its ``mp``)."""
        return self.num_processes * self.num_nodes

    def _split_step(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        step = getattr(super(), hook)
        if self.splitter is None:
            return step(*args, **kwargs)
        with self.splitter.running():
            return step(*args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.splitter is not None:
            self.splitter.before_training_step(args[0] if args else kwargs.get("batch"))
        return self._split_step("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._split_step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._split_step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._split_step("predict_step", *args, **kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any):
        closure_loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        if self.splitter is not None:
            self.splitter.after_backward()
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any):
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.splitter is not None:
            self.splitter.after_optimizer_step(optimizer)
        return output

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
        if buckets is None:
            with super().block_backward_sync():
                yield
            return
        with buckets.no_sync():
            yield

    # ---- checkpoints ----------------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        local = super().lightning_module_state_dict()
        return self.splitter.full_state_dict(local) if self.splitter is not None else local

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.splitter is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        state = self.splitter.piece_state_dict(checkpoint["state_dict"])
        self.lightning_module.load_state_dict(state, strict=strict)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        local = super().optimizer_state(optimizer)
        if self.splitter is None:
            return local
        return self.splitter.full_optimizer_state(local, optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        if self.splitter is None or not self.splitter.load_optimizer_states(
            self.optimizers, states
        ):
            super().load_optimizer_state_dict(checkpoint)

    # ---- end of a run ---------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        if liveness.current() is not None:
            liveness.current().finish()  # done with this stage: peers stop watching
        if self.trace_dir is not None and self.trace is not None:
            save_trace(self.trace, self.trace_dir / f"rank{self.global_rank}.json")
        super().teardown()

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor):
            return tensor
        return super().reduce(tensor, group=group, reduce_op=reduce_op)


def _destroy_process_group() -> None:
    liveness.stop_watching()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
