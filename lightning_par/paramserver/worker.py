"""The worker side: push each gradient bucket as backward produces it, pull in forward order.

:class:`ParameterClient` plugs a push into :class:`~lightning_par.comm.buckets.GradientBuckets`:
when backward has filled a bucket (the last layers first), its gradient slices go to
their servers on the communication thread while backward continues below, and the
receive of the updated slices is posted at once. The worker itself never steps an
optimiser. A forward pre-hook on every module that owns parameters waits for the pulls of
just that module's buckets, so the next forward starts as soon as its first layer's
weights are back (course material 002: "nodes wait for these updates before
forward-propagating").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_par.comm import CommError, CommTrace, Communicator, Handle
from lightning_par.comm.buckets import Bucket, GradientBuckets
from lightning_par.paramserver.faults import explain
from lightning_par.paramserver.messages import (
    GET_STATE,
    SET_STATE,
    STEP,
    STOP,
    ServerSpec,
    hyper_schema,
    hyper_values,
    recv_object,
    send_header,
    send_object,
    server_rank,
)
from lightning_par.paramserver.plan import plan_shards

#: Optimisers that update each element from that element's gradient and state only, so
#: slicing a tensor over servers changes nothing (LBFGS, Adafactor-style factored or
#: matrix optimisers would not be exact).
ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Rprop,
)


def check_optimizer(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    """Refuse optimisers the servers cannot reproduce exactly."""
    if not isinstance(optimizer, ELEMENTWISE):
        raise ValueError(
            f"the parameter server cannot run {type(optimizer).__name__}: its servers apply "
            "the optimiser to slices of the parameters, which is exact only for element-wise "
            f"optimisers ({', '.join(c.__name__ for c in ELEMENTWISE)})"
        )
    in_optimizer = [p for g in optimizer.param_groups for p in g["params"]]
    if {id(p) for p in in_optimizer} != {id(p) for p in params} or len(in_optimizer) != len(params):
        raise ValueError(
            "the parameter server needs one optimiser holding every trainable parameter of "
            "the model exactly once (freeze parameters with requires_grad=False instead)"
        )
    if len({p.dtype for p in params}) != 1:
        raise ValueError("the parameter server needs all trainable parameters in one dtype")


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
    ) -> None:
        params = [p for p in module.parameters() if p.requires_grad]
        check_optimizer(optimizer, params)
        self.module, self.optimizer, self.comm = module, optimizer, comm
        self.rank, self.num_workers = comm.rank, num_workers
        self.servers = [server_rank(num_workers, s) for s in range(num_servers)]
        self.params = params
        self.buckets = GradientBuckets(
            module,
            self._push,
            lambda bucket: None,
            bucket_cap_mb=bucket_cap_mb,
            trace=trace,
            rank=comm.rank,
        )
        index = {id(p): i for i, p in enumerate(params)}
        members = [[index[id(p)] for p in b.params] for b in self.buckets.buckets]
        plan = plan_shards(
            [p.numel() for p in params],
            [p.element_size() for p in params],
            num_servers,
            int(split_mb * 2**20),
        )
        self.plan = plan
        # layout[b][s]: (position in the bucket, piece) of bucket b's slices on server s
        self.layout = [
            [
                [(members[b].index(pc.param), pc) for pc in plan.message(members[b], s)]
                for s in range(num_servers)
            ]
            for b in range(len(members))
        ]
        self.pull = [
            [
                torch.empty(
                    sum(pc.numel for _, pc in sl), dtype=params[0].dtype, device=params[0].device
                )
                for sl in per_server
            ]
            for per_server in self.layout
        ]
        self.pending: dict[int, list[tuple[int, Handle]]] = {}
        self.schemas = [hyper_schema(g) for g in optimizer.param_groups]
        self.step = 0
        if self.rank == 0:
            spec = self._spec(members, plan)
            for server in self.servers:
                send_object(comm, spec, server)
            for b, per_server in enumerate(self.layout):
                for s, sl in enumerate(per_server):
                    if sl:
                        flat = torch.cat(
                            [
                                params[pc.param].detach().flatten()[pc.start : pc.stop]
                                for _, pc in sl
                            ]
                        )
                        comm.send(flat, self.servers[s], chunk=b, tag="init")
        for b, per_server in enumerate(self.layout):  # every worker starts from the servers'
            self.pending[b] = [
                (s, comm.irecv(self.pull[b][s], self.servers[s], chunk=b, tag="init"))
                for s, sl in enumerate(per_server)
                if sl
            ]
        self.settle()
        self._hooks = []
        for sub in module.modules():
            own = [index[id(p)] for p in sub.parameters(recurse=False) if id(p) in index]
            if own:
                needed = sorted({b for b, m in enumerate(members) if set(m) & set(own)})
                self._hooks.append(sub.register_forward_pre_hook(self._waiter(needed)))

    def _spec(self, members: list[list[int]], plan) -> ServerSpec:
        groups = [
            {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
        ]
        where = {
            id(p): (g, i)
            for g, grp in enumerate(self.optimizer.param_groups)
            for i, p in enumerate(grp["params"])
        }
        order = [id(p) for g in self.optimizer.param_groups for p in g["params"]]
        return ServerSpec(
            num_workers=self.num_workers,
            shapes=[tuple(p.shape) for p in self.params],
            dtype=self.params[0].dtype,
            buckets=members,
            plan=plan,
            optimizer_cls=type(self.optimizer),
            groups=groups,
            schemas=self.schemas,
            group_of=[where[id(p)][0] for p in self.params],
            opt_index=[order.index(id(p)) for p in self.params],
        )

    # ---- one step -------------------------------------------------------------------------
    def lrs(self) -> list[float]:
        """The numbers of every param group, as they are now (a scheduler may change them)."""
        return hyper_values(self.optimizer.param_groups, self.schemas)

    def _push(self, bucket: Bucket) -> None:
        """Runs on the communication thread as soon as ``bucket`` is full."""
        b = bucket.index
        if b == 0:  # buckets start in index order: the header goes first
            try:
                send_header(self.comm, self.servers, STEP, self.step, self.lrs())
            except CommError as err:
                raise CommError(explain(
                    f"worker {self.rank}: a parameter server (ranks {self.servers}) did not "
                    f"take step {self.step}'s header: {err}"
                )) from err  # fmt: skip
        sends, pulls = [], []
        for s, sl in enumerate(self.layout[b]):
            if not sl:
                continue
            grads = [bucket.views[i].flatten()[pc.start : pc.stop] for i, pc in sl]
            flags = torch.stack([bucket.flags[i] for i, _ in sl])
            message = torch.cat([*grads, flags])
            server = self.servers[s]
            sends.append((s, self.comm.isend(message, server, step=self.step, chunk=b, tag="push")))
            pulls.append(
                (s, self.comm.irecv(self.pull[b][s], server, step=self.step, chunk=b, tag="pull"))
            )
        self.pending[b] = pulls
        for s, handle in sends:
            try:
                handle.wait()
            except CommError as err:
                raise CommError(explain(
                    f"worker {self.rank}: push to parameter server {s} "
                    f"(rank {self.servers[s]}) failed: {err}"
                )) from err  # fmt: skip

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
        pulls = self.pending.pop(b, None)
        if not pulls:
            return
        with torch.no_grad():
            for s, handle in pulls:
                try:
                    flat = handle.wait()
                except CommError as err:
                    raise CommError(explain(
                        f"worker {self.rank}: no update from parameter server {s} "
                        f"(rank {self.servers[s]}): {err}"
                    )) from err  # fmt: skip
                offset = 0
                for _, pc in self.layout[b][s]:
                    target = self.params[pc.param].data.view(-1)[pc.start : pc.stop]
                    target.copy_(flat[offset : offset + pc.numel])
                    offset += pc.numel

    def settle(self) -> None:
        """Wait for every outstanding pull (before evaluation, checkpoints, the end)."""
        for b in list(self.pending):
            self.wait_bucket(b)

    # ---- commands -------------------------------------------------------------------------
    def gather_state(self) -> dict[str, Any]:
        """The full optimiser ``state_dict`` from the servers' slices (complete on worker 0;
        every worker must call this)."""
        self.settle()
        send_header(self.comm, self.servers, GET_STATE, self.step, self.lrs())
        result = self.optimizer.state_dict()
        if self.rank != 0:
            return result
        full: dict[int, dict[str, Any]] = {}
        for server in self.servers:
            for (param, start, stop), state in recv_object(self.comm, server).items():
                p = self.params[param]
                entry = full.setdefault(param, {})
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and v.dim() >= 1:
                        flat = entry.setdefault(k, torch.zeros(p.numel(), dtype=v.dtype))
                        flat[start:stop] = v
                    else:
                        entry[k] = v
        opt_index = [self._spec_index(i) for i in range(len(self.params))]
        result["state"] = {
            opt_index[i]: {
                k: (
                    v.view(self.params[i].shape)
                    if isinstance(v, torch.Tensor) and v.dim() >= 1
                    else v
                )
                for k, v in st.items()
            }
            for i, st in sorted(full.items())
        }
        return result

    def _spec_index(self, i: int) -> int:
        order = [id(p) for g in self.optimizer.param_groups for p in g["params"]]
        return order.index(id(self.params[i]))

    def load_state(self, state_dict: dict[str, Any]) -> None:
        """Send a full optimiser ``state_dict`` to the servers (every worker calls this)."""
        self.settle()
        self.optimizer.load_state_dict({**state_dict, "state": {}})  # lr etc. for schedulers
        send_header(self.comm, self.servers, SET_STATE, self.step, self.lrs())
        if self.rank == 0:
            for server in self.servers:
                send_object(self.comm, state_dict, server)

    def close(self) -> None:
        """Wait for the last pulls and stop the servers (every worker calls this)."""
        self.settle()
        send_header(self.comm, self.servers, STOP, self.step, self.lrs())
        for hook in self._hooks:
            hook.remove()
        self.buckets.close()
