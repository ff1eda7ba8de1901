"""What ``parameter_server`` and ``async_sgd`` share: the Lightning hooks they hand to their
:class:`~lightning_par.components.server_group.ServerGroup`.

Both strategies are data parallelism through server processes (Li et al., OSDI 2014): the
workers push gradients to ``S`` servers, which step the user's optimiser and send the
weights back. They differ in the update rule (every worker's gradient averaged, or each
applied as it arrives) and in what follows from it; everything else is this class, one
hook per Lightning step:

* ``check_before_launch``: refuse what the servers cannot run exactly (:mod:`._ps_features`);
* ``rank_name``: ``worker r`` or ``parameter server s`` in reports;
* ``broadcast``, ``all_gather``, ``sync_model_states``: among the workers only (the servers
  are in no loop); every worker starts from worker 0's weights;
* ``gradient_buckets``: the accumulating micro-steps push nothing;
* ``pre_backward`` / ``post_backward``: wait for the layers pulled last step / for this
  step's pushes;
* ``optimizer_step``: the closure and the pre-step hooks; the servers step the optimiser;
* ``validation_step``, ``test_step``, ``predict_step``: every pulled layer is in first;
* ``optimizer_state`` / ``load_optimizer_state_dict``: the full state gathered from the
  servers / a checkpoint's state sent to them; ``on_train_end`` keeps the servers' final
  state for a save after ``fit``;
* ``on_exception``, ``describe_failure``: name a server that failed, no goodbye;
* ``teardown``: the goodbye; the servers and their process group end.

Each strategy writes the rest in its own file: ``__init__`` (its options and its
client), ``setup_distributed`` (which options the servers start with, through
:meth:`ServerGroupStrategy.start_servers`), ``setup``, ``training_step``, ``barrier`` and
``reduce``, ``lightning_module_state_dict`` and ``watched_ranks``.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_par import _compat
from lightning_par.comm.buckets import GradientBuckets
from lightning_par.components.server_group import ServerGroup
from lightning_par.components.worker_context import WorkerContext
from lightning_par.launch import script_keeper
from lightning_par.paramserver.process import role_name
from lightning_par.strategies._base import ParStrategy
from lightning_par.strategies._late_params import refuse_frozen_in_optimizer
from lightning_par.strategies._launchers import log_startup
from lightning_par.strategies._ps_features import check_features
from lightning_par.strategies._resilience import Resilience


class ServerGroupStrategy(ParStrategy):
    """Data parallelism through parameter servers: the hooks both ``parameter_server`` and
    ``async_sgd`` hand to :attr:`servers` (see the module docstring). A strategy subclasses
    it, builds :attr:`servers` in ``__init__`` and starts them in ``setup_distributed`` with
    :meth:`start_servers`.

    Why a named base, not one strategy class with a ``staleness`` option: the two take
    different options (``bucket_cap_mb``; ``staleness``, ``share_work``, the remedies) and
    the command line offers each class's own signature; ``async_sgd(staleness=0)`` trains
    the synchronous server's weights but runs otherwise (one push after backward to
    asynchronous servers, the ``staleness`` log, no lock-step while fitting, a lost worker
    survived), so one class would ask "asynchronous?" in most of its hooks. Why not the
    class decorator this replaces: it installed these hooks at import, out of a reader's
    sight. The cost is a third class of ours above Lightning's, the one exception
    ``tests/test_strategy_classes.py`` allows (``FAMILY_BASES``): registered under no name,
    and neither strategy redefines a hook written here, so each hook is in one place.
    """

    #: the server processes and this worker's client (built by the strategy's ``__init__``)
    servers: ServerGroup
    num_servers: int
    #: ``fault_tolerant``'s refusals (what a lost worker would leave inexact), if it has one
    resilience: Resilience | None = None

    # ---- called by the strategies' own hooks ----------------------------------------------------
    def start_servers(self, server_options: dict[str, Any]) -> None:
        """``setup_distributed``, once the ranks are set: this node's servers, started with
        ``server_options``, and the process group of workers and servers."""
        # (fault_tolerant: a call after one that lost workers goes on without them)
        members = self.servers.call_members = self.servers.members(self.world_size)
        # (the first member on this node starts its servers: local rank 0 may be lost)
        node = [m for m in members if m // self.num_processes == self.node_rank]
        context = WorkerContext(
            strategy_name=self.strategy_name,
            workers=len(members),
            rank=members.index(self.global_rank),
            local_rank=node.index(self.global_rank),
            node_rank=self.node_rank,
            num_nodes=self.num_nodes,
            timeout=self.timeout,
            group_store=self.group_store,
            outlives_the_call=not getattr(self.launcher, "carries_back", False),
            dead_peer_s=self.dead_peer_timeout,
        )
        # (fault_tolerant: they outlive worker 0, whose share the first survivor takes over,
        # where the job's store does: under popen only behind the script's keeper, else
        # worker 0 is the user's script itself, which holds the store)
        popen = getattr(self.launch_plan, "method", None) == "popen"
        kept = not popen or script_keeper.runs_behind_keeper()
        outlive = {"outlive": True} if self.servers.fault_tolerant and kept else {}
        self.servers.start(context, {**server_options, **outlive}, self.watched_ranks(),
                           self.lightning_module)  # fmt: skip
        name = f"{self.strategy_name} ({self.num_servers} server(s))"
        log_startup(name, self.world_size, self.launch_plan, "gloo")

    def connect_servers(self, client_options: dict[str, Any]) -> None:
        """``setup`` when fitting: the client over the model and its one optimiser."""
        if len(self.optimizers) != 1:
            raise ValueError(
                f"{self.strategy_name} runs one optimiser; configure_optimizers "
                f"returned {len(self.optimizers)}"
            )
        assert self.model is not None and self.comm is not None
        optimizer = self.optimizers[0]
        refuse_frozen_in_optimizer(self.model, optimizer, self.strategy_name)
        self.servers.connect(self.model, optimizer, self.comm, self.trace, client_options)

    @property
    def worker_group(self) -> Any:
        """The workers' process group (ranks ``0 .. W-1``; the servers are not in it)."""
        return self.servers.workers.group

    # ---- before launch, and names ---------------------------------------------------------------
    @override
    def check_before_launch(self, trainer: pl.Trainer | None) -> None:
        """Refuse what the servers cannot do exactly (:mod:`._ps_features`), and what every
        strategy refuses (a checkpoint that cannot be read)."""
        super().check_before_launch(trainer)
        check_features(self.strategy_name, self.lightning_module, trainer, _compat.layer_sync(self))
        if self.resilience is not None:
            self.resilience.check_before_launch(trainer)

    @override
    def rank_name(self, rank: int) -> str:
        # (the workers' count from the devices: also right in the launching process, where
        # Lightning has not set the world size yet)
        return role_name(self.num_processes * self.num_nodes, rank)

    # ---- Lightning's collectives: among the workers ---------------------------------------------
    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.servers.workers.broadcast(obj, src)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False):
        return super().all_gather(tensor, group=group or self.worker_group, sync_grads=sync_grads)

    @override
    def sync_model_states(self) -> None:
        """Every worker starts from worker 0's weights (over the workers' group)."""
        self.servers.workers.sync_model_states(self.model)

    # ---- the step: through the servers ----------------------------------------------------------
    @override
    def gradient_buckets(self) -> GradientBuckets | None:
        """Gradient accumulation: no push on the accumulating micro-steps."""
        client = self.servers.client
        return client.buckets if client is not None else None

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        self.servers.pre_backward()

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        self.servers.post_backward()

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any):
        """The servers step the optimiser (:meth:`ServerGroup.step`)."""
        if self.servers.client is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        module = model if isinstance(model, pl.LightningModule) else self.lightning_module
        return self.servers.step(optimizer, closure, module, self.precision_plugin)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self.servers.settle()  # every pulled layer is in before evaluating
        return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self.servers.settle()
        return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self.servers.settle()
        return super().predict_step(*args, **kwargs)

    # ---- checkpoints: the optimiser state is on the servers -------------------------------------
    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        client = self.servers.client
        if client is None:  # after fit: the state the servers held at its end
            return self.servers.final_state or super().optimizer_state(optimizer)
        return client.gather_state()  # complete on worker 0, which writes the file

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        client = self.servers.client
        if client is None:
            return super().load_optimizer_state_dict(checkpoint)
        states = checkpoint["optimizer_states"]
        if not states:  # as Lightning's DDP: a checkpoint without one starts the optimiser anew
            rank_zero_warn(
                f"{self.strategy_name}: the checkpoint holds no optimiser state (saved in the "
                "script after a fork launch of Lightning's own DDP?); the servers' optimiser "
                "starts afresh"
            )
            return None
        client.load_state(states[0])

    @override
    def on_train_end(self) -> None:
        # the last pulls are the run's: waited for (and traced) before the state is gathered
        # outside the trace, for the script (a fork launch) or for a later save (below)
        self.servers.settle()
        super().on_train_end()
        client, context = self.servers.client, self.servers.context
        if client is not None and context is not None and context.outlives_the_call:
            # the script goes on in these ranks and may save a checkpoint after the servers
            # are gone: keep what they hold now
            with self.trace.left_out() if self.trace is not None else nullcontext():
                self.servers.final_state = client.gather_state()

    # ---- the end --------------------------------------------------------------------------------
    @override
    def on_exception(self, exception: BaseException) -> None:
        # under torchrun Lightning calls this in the rank (a fork launch: in the main process)
        self.servers.on_exception(exception)

    @override
    def describe_failure(self, error: BaseException) -> None:
        self.servers.describe_failure(error)

    @override
    def teardown(self) -> None:
        trainer = _compat.attached_trainer(self.lightning_module)  # None once detached
        interrupted = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
        self.servers.close(self.comm, interrupted)
        super().teardown()
