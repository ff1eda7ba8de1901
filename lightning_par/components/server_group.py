"""The parameter-server plumbing that a strategy holds: server processes, one process group
of workers and servers, the worker-side client and the goodbye.

Both the synchronous parameter server and asynchronous SGD are *data parallelism through
server processes* (Li et al., "Scaling Distributed Machine Learning with the Parameter
Server", OSDI 2014): each node's local rank 0 starts its share of ``S`` servers
(:mod:`lightning_par.paramserver.process`), all ``W + S`` ranks join one gloo group,
Lightning's collectives run among the workers only (:class:`WorkerGroup`), and a
:class:`~lightning_par.paramserver.ParameterClient` (or its asynchronous variant) pushes
gradients and pulls weights. :class:`ServerGroup` is that plumbing as one object, so that
each strategy is *this update rule = a server group + these Lightning hooks* instead of a
subclass of the other. What differs between the two strategies comes in as arguments: the
client class, the servers' options and the client's options.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerStatus

from lightning_par import _compat
from lightning_par.comm import Event
from lightning_par.components.process_group import destroy_process_group
from lightning_par.components.worker_group import WorkerGroup, check_positive
from lightning_par.launch import liveness
from lightning_par.paramserver import process as servers
from lightning_par.paramserver.faults import explain
from lightning_par.paramserver.worker import ParameterClient


def gloo_only(kwargs: dict[str, Any]) -> None:
    """Take ``process_group_backend`` out of ``kwargs``: only gloo (or unset) is allowed."""
    backend = kwargs.pop("process_group_backend", None)
    if backend not in (None, "gloo"):
        raise ValueError(
            f"process_group_backend={backend!r}: the parameter server talks to CPU servers "
            "over gloo (CUDA workers stage through pinned memory); leave it unset"
        )


class _BetweenCalls:
    """The workers-only group a server group left for the script's next call, if any."""

    group: Any = None


_between_calls = _BetweenCalls()


def _end_group_between_calls() -> None:
    if dist.is_initialized() and dist.group.WORLD is _between_calls.group:
        dist.destroy_process_group()
    _between_calls.group = None


class ServerGroup:
    """``num_servers`` server processes and this worker's client, for the strategy ``host``.

    Args:
        host: the strategy (its ranks, timeout, communicator, trace and model are read).
        num_servers, bucket_cap_mb, split_mb: see the strategies.
        client_cls: :class:`ParameterClient` or a subclass.
    """

    def __init__(
        self,
        host: Any,
        num_servers: int,
        bucket_cap_mb: float,
        split_mb: float,
        client_cls: type[ParameterClient] = ParameterClient,
    ) -> None:
        check_positive("num_servers", num_servers, int)
        check_positive("bucket_cap_mb", bucket_cap_mb)
        check_positive("split_mb", split_mb)
        self.host = host
        self.num_servers, self.bucket_cap_mb, self.split_mb = num_servers, bucket_cap_mb, split_mb
        self.client_cls = client_cls
        self.client: ParameterClient | None = None
        #: Lightning's collectives among the workers only (the servers are in no loop)
        self.workers = WorkerGroup()
        #: the server processes this process started (each node's local rank 0 its share)
        self.processes: list = []
        self.started: list[int] = []
        self._watch: Any = None
        self.failed = False
        #: the servers' optimiser state at the end of the last fit, for a checkpoint saved
        #: after it in ranks that outlive the call (popen, torchrun)
        self.final_state: dict[str, Any] | None = None
        self._backward_start = 0.0

    # ---- processes -----------------------------------------------------------------------------
    def start(self, server_options: dict[str, Any], watched: list[int]) -> None:
        """Start this node's servers, join the group of workers and servers, watch them."""
        host = self.host
        if _between_calls.group is not None:  # the workers' group kept since the last call
            _end_group_between_calls()  # (of this strategy or another's) ends here
        if dist.is_initialized():
            raise RuntimeError(
                f"{host.strategy_name} builds its own process group of workers and servers; it "
                "cannot join one that exists. Start W workers (Trainer(devices=W), torchrun "
                "--nproc-per-node W) without initialising torch.distributed first"
            )
        workers = host.world_size
        store, address = host.group_store()
        if host.local_rank == 0:  # each node starts its share of the servers
            mine = servers.servers_of_node(self.num_servers, host.num_nodes, host.node_rank)
            self.started = mine
            self.processes = servers.start_servers(
                mine, workers, self.num_servers, address, host.timeout, **server_options
            )
        dist.init_process_group(
            "gloo",
            store=store,
            rank=host.global_rank,
            world_size=workers + self.num_servers,
            timeout=host.timeout,
        )
        self._watch = servers.watch_servers(self.processes, workers) if self.processes else None
        liveness.watch_group(store, host.global_rank, watched, host.timeout, host.rank_name)
        self.workers.create(workers)
        self.workers.prepare_data(host.lightning_module)

    def watch_sigterm(self, trainer: pl.Trainer) -> None:
        """Lightning broadcasts a SIGTERM flag on the default group every step; servers are in
        that group but not in the loop, so the flag travels among the workers only."""
        rank = self.host.global_rank
        _compat.replace_sigterm_broadcast(
            trainer, lambda: self.workers.broadcast_sigterm(trainer, rank)
        )

    def connect(self, options: dict[str, Any], check: Callable[[Any], None]) -> None:
        """The client over the model and the (single) optimiser, which ``check`` sees first;
        ``options`` go to the client."""
        host = self.host
        if len(host.optimizers) != 1:
            raise ValueError(
                f"{host.strategy_name} runs one optimiser; configure_optimizers "
                f"returned {len(host.optimizers)}"
            )
        assert host.model is not None and host.comm is not None
        check(host.optimizers[0])
        self.final_state = None
        self.client = self.client_cls(
            host.model,
            host.optimizers[0],
            host.comm,
            host.world_size,
            self.num_servers,
            bucket_cap_mb=self.bucket_cap_mb,
            split_mb=self.split_mb,
            trace=host.trace,
            name=host.strategy_name,
            **options,
        )

    # ---- the step ------------------------------------------------------------------------------
    def settle(self) -> None:
        """Wait for every pulled layer (any the forward did not wait for)."""
        if self.client is not None:
            self.client.settle()

    def pre_backward(self) -> None:
        self.settle()  # any layer the forward did not wait for (unused, reused)
        if self.host.trace is not None:
            self._backward_start = self.host.trace.now()

    def post_backward(self) -> None:
        trace = self.host.trace
        if self.client is None or not self.client.buckets.enabled:
            return
        if trace is None:
            self.client.finish_backward()
            return
        trace.events.append(
            Event(self.host.global_rank, "backward", self._backward_start, trace.now())
        )
        with trace.span("wait for pushes"):
            self.client.finish_backward()

    def step(self, optimizer: Any, closure: Callable[[], Any], model: Any) -> Any:
        """Forward, backward (which pushed the gradients) and the pre-step hooks; the servers
        step the optimiser, so the worker's ``optimizer.step`` is not called."""
        host = self.host
        result = closure()
        if result is None:
            raise RuntimeError(
                f"{host.strategy_name}: training_step returned None; every worker "
                "must push every step (the servers wait for all of them)"
            )
        module = model if isinstance(model, pl.LightningModule) else host.lightning_module
        _compat.after_closure(host.precision_plugin, module, optimizer)
        _compat.mark_optimizer_stepped(optimizer)  # it did, on the servers: no scheduler warning
        return result

    # ---- the end -------------------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        """No goodbye protocol after a failure; a server's message may name who failed."""
        self.failed = True  # peers may be mid-step or gone
        self.describe_failure(exception)
        if self.client is None or not isinstance(exception, RuntimeError):
            return
        if exception.args and isinstance(exception.args[0], str):  # a server may know who
            exception.args = (explain(exception.args[0]), *exception.args[1:])

    def describe_failure(self, error: BaseException) -> None:
        """Name a server that died, if one did."""
        if dist.is_initialized():
            servers.name_dead_server(error, self.host.global_rank)

    def close(self) -> None:
        """Say goodbye to the servers (after a clean run), end them and the group."""
        host = self.host
        trainer = _compat.attached_trainer(host.lightning_module)  # None once detached
        interrupted = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
        clean = not (interrupted or self.failed) and dist.is_initialized()
        if self.client is not None:
            if clean:
                self.client.close()
            self.client = None
        elif clean and host.global_rank == 0 and host.comm is not None:
            self.client_cls.close_untrained(host.comm, host.world_size, self.num_servers)
        if self._watch is not None:
            self._watch.set()  # the servers end now: no longer news
        if self.processes:
            servers.stop_servers(self.processes, wait_s=10.0 if clean else 0.0)
            self.processes = []
        liveness.stop_watching()
        if clean:  # the servers are gone: a later fit/test/validate builds a new group
            dist.destroy_process_group()
            if self.ranks_outlive_the_call():
                self._join_workers_between_calls()

    def ranks_outlive_the_call(self) -> bool:
        """Whether the user's script goes on in these ranks after ``fit``/``validate``/...
        (popen, torchrun, SLURM) rather than in a process that forked them."""
        return not getattr(self.host.launcher, "carries_back", False)

    def _join_workers_between_calls(self) -> None:
        """The script goes on in every worker: Lightning's barrier in ``save_checkpoint``
        and the collectives of the next call's set-up need a group, as under Lightning's
        DDP, whose group lives on after ``fit``. The servers are gone: the workers alone."""
        host = self.host
        store, _ = host.group_store()
        dist.init_process_group("gloo", store=store, rank=host.global_rank,
                                world_size=host.world_size, timeout=host.timeout)  # fmt: skip
        self.workers.group = None  # the default group holds the workers alone
        _between_calls.group = dist.group.WORLD
        atexit.register(destroy_process_group)  # (a gloo group alive at exit can abort it)

    def all_ranks(self) -> list[int]:
        return list(range(self.host.world_size + self.num_servers))
