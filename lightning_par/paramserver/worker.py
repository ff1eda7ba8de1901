"""The worker side: push each gradient bucket as backward produces it, pull in forward order.

:class:`ParameterClient` plugs a push into :class:`~lightning_par.comm.buckets.GradientBuckets`:
when backward has filled a bucket (the last layers first), its gradient slices go to
their servers on the communication thread while backward continues below, and the
receive of the updated slices is posted at once. The worker itself never steps an
optimiser. A forward pre-hook on every module that owns parameters waits for the pulls of
just that module's buckets, so the next forward starts as soon as its first layer's
weights are back (course material 002: "nodes wait for these updates before
forward-propagating").

What goes to which server is planned once (:mod:`~lightning_par.paramserver.client_plan`,
a pure function of sizes and servers); the bytes move in
:class:`~lightning_par.paramserver.links.ServerLinks`. The asynchronous client
(:mod:`~lightning_par.paramserver.async_client`) reuses both and changes only what is
sent around them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_par.comm import CommError, CommTrace, Communicator, Handle
from lightning_par.comm.buckets import Bucket, GradientBuckets
from lightning_par.paramserver import protocol
from lightning_par.paramserver.client_plan import plan_client
from lightning_par.paramserver.clipping import GradClip
from lightning_par.paramserver.faults import explain
from lightning_par.paramserver.links import ServerLinks
from lightning_par.paramserver.messages import recv_object, send_headers, send_object
from lightning_par.paramserver.protocol import NONE, Command, Header, Kind, server_rank
from lightning_par.paramserver.spec import (
    ServerSpec,
    check_optimizer,
    hyper_schema,
    hyper_values,
    optimizer_index,
    server_spec,
)


class ParameterClient:
    """A worker's connection to the servers (group ranks ``W .. W+S-1``).

    Args:
        module: the model (every worker builds the same one).
        optimizer: the user's optimiser; its class and param groups run on the servers.
        comm: a Communicator over the group of workers and servers.
        num_workers, num_servers: ``W`` and ``S``.
        bucket_cap_mb: gradient bucket size (MiB); small buckets push layer by layer.
        split_mb: tensors larger than this (MiB) are split over all servers.
        trace: records ``bucket i`` events (push of that bucket) besides the messages.
        clip: clipping of the averaged gradient, done by the servers
            (:mod:`~lightning_par.paramserver.clipping`).
        name: who refuses an optimiser it cannot run (the strategy's name).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        comm: Communicator,
        num_workers: int,
        num_servers: int,
        *,
        bucket_cap_mb: float = 1.0,
        split_mb: float = 1.0,
        trace: CommTrace | None = None,
        clip: GradClip | None = None,
        name: str = "the parameter server",
    ) -> None:
        params = [p for p in module.parameters() if p.requires_grad]
        check_optimizer(optimizer, params, name)
        self.name = name
        self.module, self.optimizer, self.comm, self.params = module, optimizer, comm, params
        self.rank, self.num_workers = comm.rank, num_workers
        self.servers = [server_rank(num_workers, s) for s in range(num_servers)]
        self.schemas = [hyper_schema(g) for g in optimizer.param_groups]
        self.step = 0
        self.trained: tuple[int, int] = (NONE, NONE)  # shared work: acknowledged per push
        self.buckets = GradientBuckets(
            module, self._push, lambda bucket: None, bucket_cap_mb=bucket_cap_mb, trace=trace,
            rank=comm.rank,
        )  # fmt: skip
        index = {id(p): i for i, p in enumerate(params)}
        members = [[index[id(p)] for p in b.params] for b in self.buckets.buckets]
        self.layout = plan_client(
            [p.numel() for p in params], [p.element_size() for p in params], members,
            num_servers, int(split_mb * 2**20),
        )  # fmt: skip
        self.plan = self.layout.shards
        self.links = self.make_links()
        spec = server_spec(optimizer, params, num_workers, members, self.plan, clip)
        self.begin(spec if self.rank == 0 else None)
        self.settle()
        self._hooks = []
        for sub in module.modules():
            own = [index[id(p)] for p in sub.parameters(recurse=False) if id(p) in index]
            if own:
                needed = self.layout.buckets_of(own)
                self._hooks.append(sub.register_forward_pre_hook(self._waiter(needed)))

    def make_links(self) -> ServerLinks:
        """The object that moves this worker's pushes and pulls."""
        return ServerLinks(self.comm, self.layout, self.params, self.servers)

    def begin(self, spec: ServerSpec | None) -> None:
        """Worker 0 (``spec``): the spec to every server, then their initial slices; every
        worker: the receive of the servers' initial weights, where every worker starts."""
        if spec is not None:
            for server in self.servers:
                send_object(self.comm, spec, server)
            self.links.send_initial()
        self.links.post_pulls(Kind.INIT)

    # ---- one step -------------------------------------------------------------------------
    def lrs(self) -> list[float]:
        """The numbers of every param group, as they are now (a scheduler may change them)."""
        return hyper_values(self.optimizer.param_groups, self.schemas)

    def header(self, command: Command, step: int | None = None, count: int = NONE) -> Header:
        """A header of this worker's state (``step`` defaults to its step)."""
        step = self.step if step is None else step
        return Header(command, step, tuple(self.lrs()), self.trained, count)

    def _open_step(self) -> list[tuple[int, Handle]]:
        """The step's header, before the first push: sent and waited for here."""
        try:
            send_headers(self.comm, self.servers, self.header(Command.STEP))
        except CommError as err:
            raise CommError(explain(
                f"worker {self.rank}: a parameter server (ranks {self.servers}) did not "
                f"take step {self.step}'s header: {err}"
            )) from err  # fmt: skip
        return []

    def _pushed(self, bucket: int) -> None:
        """After a bucket's push was posted (the asynchronous client posts more)."""

    def _push(self, bucket: Bucket) -> None:
        """Runs on the communication thread as soon as ``bucket`` is full."""
        b = bucket.index
        sends = self._open_step() if b == 0 else []  # buckets start in index order
        sends += self.links.push(bucket, self.step)
        self._pushed(b)
        self.links.wait_sends(sends)

    def finish_backward(self) -> None:
        """After backward: push what is left and wait until every push has gone."""
        self.buckets.synchronize()
        self.step += 1

    def _waiter(self, needed: list[int]):
        def hook(module: nn.Module, args: Any) -> None:
            for b in needed:
                self.wait_bucket(b)

        return hook

    def wait_bucket(self, b: int) -> None:
        """Wait for bucket ``b``'s updated slices and write them into the parameters."""
        self.links.wait_bucket(b)

    def settle(self) -> None:
        """Wait for every outstanding pull (before evaluation, checkpoints, the end)."""
        while self.links.pending:  # (a wait may post a pull again: fault_tolerant)
            self.wait_bucket(next(iter(self.links.pending)))

    # ---- commands -------------------------------------------------------------------------
    def gather_state(self) -> dict[str, Any]:
        """The full optimiser ``state_dict`` from the servers' slices (complete on worker 0;
        every worker must call this)."""
        self.settle()
        send_headers(self.comm, self.servers, self.header(Command.GET_STATE))
        result = self.optimizer.state_dict()
        if self.rank != 0:
            return result
        shards = [recv_object(self.comm, server, protocol.decode_state) for server in self.servers]
        return self.full_state(result, shards)

    def full_state(
        self, result: dict[str, Any], shards: list[dict[tuple[int, int, int], Any]]
    ) -> dict[str, Any]:
        """``result`` (the worker optimiser's ``state_dict``) with the state of every slice
        of every server's ``shards`` put together, in the user's optimiser's format."""
        full: dict[int, dict[str, Any]] = {}
        for slices in shards:
            for (param, start, stop), state in slices.items():
                p = self.params[param]
                entry = full.setdefault(param, {})
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and v.dim() >= 1:
                        flat = entry.setdefault(k, torch.zeros(p.numel(), dtype=v.dtype))
                        flat[start:stop] = v
                    else:
                        entry[k] = v
        opt_index = optimizer_index(self.optimizer, self.params)
        result["state"] = {
            opt_index[i]: {
                k: v.view(self.params[i].shape) if isinstance(v, torch.Tensor) and v.dim() >= 1
                else v
                for k, v in st.items()
            }
            for i, st in sorted(full.items())
        }  # fmt: skip
        return result

    def load_state(self, state_dict: dict[str, Any]) -> None:
        """Send a full optimiser ``state_dict`` to the servers (every worker calls this)."""
        self.settle()
        self.optimizer.load_state_dict({**state_dict, "state": {}})  # lr etc. for schedulers
        send_headers(self.comm, self.servers, self.header(Command.SET_STATE))
        if self.rank == 0:
            for server in self.servers:
                send_object(self.comm, state_dict, server)

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self.buckets.close()

    @staticmethod
    def close_untrained(comm: Communicator, num_workers: int, num_servers: int) -> None:
        """Worker 0, when no client was built (``fit`` ended before any step): tell every
        server to end. The servers wait for a spec first; ``None`` in its place means stop."""
        for s in range(num_servers):
            send_object(comm, None, server_rank(num_workers, s))

    def close(self) -> None:
        """Wait for the last pulls and stop the servers (every worker calls this)."""
        self.settle()
        send_headers(self.comm, self.servers, self.header(Command.STOP))
        self.remove_hooks()
