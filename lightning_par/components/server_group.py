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

The group takes what it uses, not its strategy: a
:class:`~lightning_par.components.worker_context.WorkerContext` (names, ranks, store,
timeout) when the servers start, the model, optimiser, communicator and trace when the
client connects, and the precision plugin at each step. After a clean call in a script that
goes on, the workers keep a group of their own
(:mod:`~lightning_par.components.workers_between_calls`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist

from lightning_par import _compat
from lightning_par.comm import CommTrace, Communicator
from lightning_par.components.worker_context import WorkerContext
from lightning_par.components.worker_group import WorkerGroup, check_positive
from lightning_par.components.workers_between_calls import end_kept_group, keep_workers_group
from lightning_par.launch import liveness
from lightning_par.launch.lost import RankLost
from lightning_par.paramserver import process as servers
from lightning_par.paramserver import server_watch
from lightning_par.paramserver.faults import explain
from lightning_par.paramserver.replication import server_processes
from lightning_par.paramserver.worker import ParameterClient


class ServerGroup:
    """``num_servers`` server processes and this worker's client.

    Args:
        num_servers, bucket_cap_mb, split_mb: see the strategies.
        client_cls: :class:`ParameterClient` or a subclass.
        fault_tolerant: each server's shard copied in the next server process (a standby
            for a lone server), a lost server's shard taken over by its copy
            (:mod:`lightning_par.paramserver.replication`).
    """

    def __init__(
        self,
        num_servers: int,
        bucket_cap_mb: float,
        split_mb: float,
        client_cls: type[ParameterClient] = ParameterClient,
        fault_tolerant: bool = False,
    ) -> None:
        check_positive("num_servers", num_servers, int)
        check_positive("bucket_cap_mb", bucket_cap_mb)
        check_positive("split_mb", split_mb)
        self.num_servers, self.bucket_cap_mb, self.split_mb = num_servers, bucket_cap_mb, split_mb
        self.client_cls, self.fault_tolerant = client_cls, fault_tolerant
        #: server processes: the shards' servers, and a lone server's standby
        self.num_processes = server_processes(num_servers, fault_tolerant)
        #: where this worker stands (:meth:`start`)
        self.context: WorkerContext | None = None
        self.client: ParameterClient | None = None
        self.trace: CommTrace | None = None
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
        #: (``fault_tolerant``) the workers lost so far, by their ranks at the first call,
        #: and the first ranks of this call's workers (a later call goes on without the lost)
        self.lost: list[int] = []
        self.call_members: list[int] = []
        self._backward_start = (0.0, 0.0)  # CommTrace.mark()

    # ---- processes -----------------------------------------------------------------------------
    def members(self, world_size: int) -> list[int]:
        """The first ranks of the workers still in the job, of the ``world_size`` at the
        start (all of them, unless a fault-tolerant run lost some)."""
        return [w for w in range(world_size) if w not in self.lost]

    def lose(self, workers: list[int]) -> None:
        """This call's workers ``workers`` (their ranks in it) were lost."""
        self.lost += [
            self.call_members[w] for w in workers if self.call_members[w] not in self.lost
        ]

    def start(
        self,
        context: WorkerContext,
        server_options: dict[str, Any],
        watched: list[int],
        module: Any,
    ) -> None:
        """Start this node's servers (``server_options`` go to each), join the group of
        workers and servers, watch the ranks ``watched``; ``module``'s ``prepare_data`` waits
        for the workers only."""
        self.context = ctx = context
        if len(self.call_members) != ctx.workers:  # (no strategy said who they are: all)
            self.call_members = list(range(ctx.workers))
        end_kept_group()  # the workers' group kept since the last call ends here
        if dist.is_initialized():
            raise RuntimeError(
                f"{ctx.strategy_name} builds its own process group of workers and servers; it "
                "cannot join one that exists. Start W workers (Trainer(devices=W), torchrun "
                "--nproc-per-node W) without initialising torch.distributed first"
            )
        store, address = ctx.group_store()
        if ctx.local_rank == 0:  # each node starts its share of the servers
            mine = servers.servers_of_node(self.num_processes, ctx.num_nodes, ctx.node_rank)
            self.started = mine
            self.processes = servers.start_servers(
                mine, ctx.workers, self.num_processes, address, ctx.timeout,
                dead_peer_s=ctx.dead_peer_s, fault_tolerant=self.fault_tolerant, **server_options,
            )  # fmt: skip
        world = ctx.workers + self.num_processes
        dist.init_process_group(
            "gloo", store=store, rank=ctx.rank, world_size=world, timeout=ctx.timeout
        )
        procs, ft = self.processes, self.fault_tolerant
        self._watch = server_watch.watch_servers(procs, ctx.workers, ft) if procs else None
        zero = server_options.get("outlive", False)  # (worker 0 too: its servers outlive it)
        survive = server_watch.fence(procs, ctx.workers, zero) if ft else None  # lost servers too
        liveness.watch_group(store, ctx.rank, watched, ctx.timeout, ctx.rank_name, ctx.dead_peer_s,
                             survive)  # fmt: skip
        self.workers.create(ctx.workers)
        self.workers.prepare_data(module)

    def watch_sigterm(self, trainer: pl.Trainer) -> None:
        """Lightning broadcasts a SIGTERM flag on the default group every step; servers are in
        that group but not in the loop, so the flag travels among the workers only."""
        rank = self._context.rank
        _compat.replace_sigterm_broadcast(
            trainer, lambda: self.workers.broadcast_sigterm(trainer, rank)
        )

    def connect(
        self,
        model: Any,
        optimizer: Any,
        comm: Communicator,
        trace: CommTrace | None,
        options: dict[str, Any],
    ) -> None:
        """The client over ``model`` and its one ``optimizer``, talking over ``comm``
        (recorded in ``trace``); ``options`` go to the client."""
        ctx = self._context
        self.final_state = None
        self.trace = trace
        self.client = self.client_cls(
            model,
            optimizer,
            comm,
            ctx.workers,
            self.num_servers,
            bucket_cap_mb=self.bucket_cap_mb,
            split_mb=self.split_mb,
            trace=trace,
            name=ctx.strategy_name,
            **options,
        )

    @property
    def _context(self) -> WorkerContext:
        assert self.context is not None, "the servers have not started (setup_distributed)"
        return self.context

    # ---- the step ------------------------------------------------------------------------------
    def settle(self) -> None:
        """Wait for every pulled layer (any the forward did not wait for); if that found
        workers lost (``fault_tolerant``), the workers' group holds the survivors from now."""
        if self.client is None:
            return
        self.client.settle()
        lost = [w for w in getattr(self.client, "lost_workers", ()) if self.call_members[w]
                not in self.lost]  # fmt: skip
        if lost:  # (every survivor learns it at the same request: they meet here together)
            self.lose(lost)
            survivors = [i for i, r in enumerate(self.call_members) if r not in self.lost]
            self.workers.regroup(survivors)

    def pre_backward(self) -> None:
        self.settle()  # any layer the forward did not wait for (unused, reused)
        if self.client is not None and self.trace is not None:
            self._backward_start = self.trace.mark()

    def post_backward(self) -> None:
        trace = self.trace
        if self.client is None or not self.client.buckets.enabled:
            return
        if trace is None:
            self.client.finish_backward()
            return
        trace.close("backward", self._backward_start)
        with trace.span("wait for pushes"):
            self.client.finish_backward()

    def step(
        self, optimizer: Any, closure: Callable[[], Any], module: pl.LightningModule, precision: Any
    ) -> Any:
        """Forward, backward (which pushed the gradients) and the pre-step hooks of
        ``precision`` (a precision plugin) and ``module``; the servers step the optimiser,
        so the worker's ``optimizer.step`` is not called."""
        result = closure()
        if result is None:
            raise RuntimeError(
                f"{self._context.strategy_name}: training_step returned None; every worker "
                "must push every step (the servers wait for all of them)"
            )
        _compat.after_closure(precision, module, optimizer)
        _compat.mark_optimizer_stepped(optimizer)  # it did, on the servers: no scheduler warning
        return result

    # ---- the end -------------------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        """No goodbye protocol after a failure; a server's message may name who failed."""
        self.failed = True  # peers may be mid-step or gone
        if isinstance(exception, RankLost):  # the launcher named the lost rank already
            return
        self.describe_failure(exception)
        if self.client is None or not isinstance(exception, RuntimeError):
            return
        if exception.args and isinstance(exception.args[0], str):  # a server may know who
            exception.args = (explain(exception.args[0]), *exception.args[1:])

    def describe_failure(self, error: BaseException) -> None:
        """Name a server that died, if one did."""
        if dist.is_initialized() and self.context is not None:
            server_watch.name_dead_server(error, self.context.rank)

    def close(self, comm: Communicator | None, interrupted: bool) -> None:
        """Say goodbye to the servers over ``comm`` (after a clean run: not ``interrupted``),
        end them and the group."""
        ctx = self.context
        clean = not (interrupted or self.failed) and dist.is_initialized() and ctx is not None
        if self.client is not None:
            if clean:
                self.client.close()
            self.lose(getattr(self.client, "lost_workers", []))
            self.client = None
        elif clean and ctx.rank == 0 and comm is not None:
            self.client_cls.close_untrained(comm, ctx.workers, self.num_processes)
        alive = [i for i, r in enumerate(self.call_members) if r not in self.lost]
        if self._watch is not None:
            self._watch.set()  # the servers end now: no longer news
        if self.processes:
            server_watch.stop_servers(self.processes, wait_s=10.0 if clean else 0.0)
            self.processes = []
        beat = liveness.current()
        liveness.stop_watching()
        if clean:  # the servers are gone: a later fit/test/validate builds a new group
            dist.destroy_process_group()
            if ctx.outlives_the_call:  # the script's next call needs a group: the workers'
                keep_workers_group(ctx, beat, alive)
                self.workers.group = self.workers.members = None  # (the survivors alone)
