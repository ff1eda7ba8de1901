"""The server side: a shard of the parameters, the user's optimiser over it, the serve loop.

Two parts, kept apart so that asynchronous SGD can reuse the first:

* :class:`ShardOptimizer` is the **update rule's state**: this server's slices of the
  parameters (one flat tensor per gradient bucket, so a pull is one message) and an
  instance of the user's optimiser class with the user's param-group hyperparameters over
  them. :meth:`ShardOptimizer.apply` applies one gradient to one bucket's slices.
* :func:`synchronous_step` is the **synchronous rule**: for each bucket, in the order
  backward produces them, wait for the pushes of all ``W`` workers, sum them, divide by
  ``W``, apply, and send the new slices to every worker (the talk's per-layer scheme,
  course material 002). An asynchronous rule would call :meth:`~ShardOptimizer.apply`
  for each push as it arrives instead.

:func:`serve` is the loop a server process runs until the workers say stop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch import nn

from lightning_par.comm import CommError, Communicator, Handle, wait_all
from lightning_par.comm.p2p import Tag
from lightning_par.paramserver import protocol
from lightning_par.paramserver.clipping import clip_value, norm_factor, squared_norm
from lightning_par.paramserver.messages import (
    exchange_squared_norms,
    recv_headers,
    recv_object,
    send_object,
)
from lightning_par.paramserver.protocol import (
    IDLE_TIMEOUT,
    Command,
    Kind,
    ProtocolError,
    ShardTag,
    server_rank,
)
from lightning_par.paramserver.spec import ServerSpec, set_hyper

Key = tuple[int, int, int]  # (parameter, start, stop) of one slice


class ShardOptimizer:
    """This server's slices of the parameters and the user's optimiser over them.

    ``server`` is the shard's index; with ``tagged`` (``fault_tolerant``) its messages travel
    on tags of their own (:class:`~lightning_par.paramserver.protocol.ShardTag`), as one
    process may hold two shards. :attr:`norms`, if set, turns this shard's squared gradient
    norm into the whole gradient's (clipping by norm) instead of the exchange with every
    other server."""

    def __init__(self, spec: ServerSpec, server: int, tagged: bool = False) -> None:
        self.spec, self.server = spec, server
        self.tag: Callable[[Kind], Tag] = partial(ShardTag, shard=server) if tagged else Kind
        self.norms: Callable[[float, int], float] | None = None
        #: every server's group rank (clipping by norm: they exchange squared norms)
        self.servers = [server_rank(spec.num_workers, s) for s in range(spec.plan.num_servers)]
        self.layout = [spec.plan.message(b, server) for b in spec.buckets]
        self.active = [b for b, pieces in enumerate(self.layout) if pieces]
        self.flat = [torch.zeros(sum(p.numel for p in m), dtype=spec.dtype) for m in self.layout]
        self.params: list[list[nn.Parameter]] = []
        self.keys: dict[int, Key] = {}  # id(slice parameter) -> its key
        groups: list[list[nn.Parameter]] = [[] for _ in spec.groups]
        for b, pieces in enumerate(self.layout):
            views, offset = [], 0
            for piece in pieces:
                # A Parameter made from a view shares its storage: the optimiser's in-place
                # update lands in self.flat[b], which is what the pull sends.
                view = nn.Parameter(self.flat[b][offset : offset + piece.numel])
                offset += piece.numel
                views.append(view)
                groups[spec.group_of[piece.param]].append(view)
                self.keys[id(view)] = (piece.param, piece.start, piece.stop)
            self.params.append(views)
        param_groups = [{**hyper, "params": ps} for hyper, ps in zip(spec.groups, groups) if ps]
        self._group_index = [g for g, ps in enumerate(groups) if ps]
        self.optimizer = spec.optimizer_cls(param_groups) if param_groups else None

    def share_initial(self, comm: Communicator, replicate: Callable[[], None] | None = None
                      ) -> None:  # fmt: skip
        """Take worker 0's initial slices (``replicate`` them) and send them to every worker
        (``INIT``)."""
        for b in self.active:
            comm.recv(self.flat[b], 0, chunk=b, tag=self.tag(Kind.INIT))
            protocol.decode_slices(self.flat[b], self.sizes(b), Kind.INIT)  # (checks it)
        if replicate is not None:
            replicate()
        wait_all([comm.isend(self.slices(b), w, chunk=b, tag=self.tag(Kind.INIT))
                  for b in self.active for w in range(self.spec.num_workers)])  # fmt: skip

    def sizes(self, bucket: int) -> list[int]:
        """The elements of each of this server's slices of ``bucket``."""
        return [piece.numel for piece in self.layout[bucket]]

    def slices(self, bucket: int) -> torch.Tensor:
        """``bucket``'s slices as an ``INIT``/``PULL`` (``self.flat[bucket]`` itself: the
        optimiser's views live in it)."""
        return protocol.encode_slices([self.flat[bucket]])

    def push_buffer(self, bucket: int) -> torch.Tensor:
        """An empty ``PUSH`` of ``bucket`` from one worker, to receive into."""
        n, slices = self.flat[bucket].numel(), len(self.layout[bucket])
        return protocol.push_buffer(n, slices, self.spec.dtype)

    def decode_push(self, bucket: int, message: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradient and "has a gradient" mask of a (summed) ``PUSH`` of ``bucket``."""
        n, slices = self.flat[bucket].numel(), len(self.layout[bucket])
        return protocol.decode_push(message, n, slices)

    def send_slices(
        self, comm: Communicator, bucket: int, workers: Iterable[int], step: int
    ) -> list[Handle]:
        """Post ``bucket``'s updated slices to ``workers`` (``PULL``)."""
        return [comm.isend(self.slices(bucket), w, step=step, chunk=bucket,
                           tag=self.tag(Kind.PULL)) for w in workers]  # fmt: skip

    def set_hyper(self, values: list[float]) -> None:
        """Hyperparameters from the workers (their schedulers run there)."""
        if self.optimizer is None:
            return
        per_group, offset = [], 0
        for schema in self.spec.schemas:
            per_group.append(values[offset : offset + len(schema)])
            offset += len(schema)
        for group, g in zip(self.optimizer.param_groups, self._group_index):
            set_hyper(group, self.spec.schemas[g], per_group[g])

    def apply(self, bucket: int, grad: torch.Tensor, used: torch.Tensor) -> None:
        """One optimiser step on ``bucket``'s slices with the flat gradient ``grad``;
        slices whose ``used`` is False keep ``grad=None`` (skipped, as in one process)."""
        offset = 0
        for view, flag in zip(self.params[bucket], used.tolist()):
            view.grad = grad[offset : offset + view.numel()] if flag else None
            offset += view.numel()
        assert self.optimizer is not None
        self.optimizer.step()  # slices of other buckets have grad None: untouched
        for view in self.params[bucket]:
            view.grad = None

    def state_slices(self) -> dict[Key, dict[str, Any]]:
        """The optimiser state of every slice (for a checkpoint)."""
        if self.optimizer is None:
            return {}
        state = self.optimizer.state
        return {self.keys[id(v)]: dict(state[v]) for ps in self.params for v in ps if v in state}

    def load_full(self, full: dict[str, Any]) -> None:
        """Take this server's slices out of a worker optimiser's full ``state_dict``."""
        if self.optimizer is None:
            return
        for group, g in zip(self.optimizer.param_groups, self._group_index):
            hyper = {k: v for k, v in full["param_groups"][g].items() if k != "params"}
            group.update(hyper)
        for views in self.params:
            for view in views:
                param, start, stop = self.keys[id(view)]
                saved = full["state"].get(self.spec.opt_index[param])
                if saved is None:
                    continue
                self.optimizer.state[view] = {
                    k: (v.detach().cpu().flatten()[start:stop].clone() if _sliced(v) else _copy(v))
                    for k, v in saved.items()
                }


def _sliced(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 1


def _copy(value: Any) -> Any:
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def apply_averaged(
    comm: Communicator, shard: ShardOptimizer, grads: dict[int, tuple[torch.Tensor, torch.Tensor]],
    step: int, applied: frozenset[int] = frozenset(),
) -> None:  # fmt: skip
    """Apply each active bucket's averaged gradient (``bucket -> (grad, used)``), clipped as
    the spec says, but not to the buckets ``applied`` already (their clipped gradient is
    still computed: a lost server's step redone by its backup); by norm every server takes
    part, even one holding no bucket."""
    clip = shard.spec.clip
    if clip is not None and clip.algorithm == "norm":
        mine = squared_norm([grad for grad, _ in grads.values()])
        if shard.norms is not None:
            total = shard.norms(mine, step)
        else:
            total = exchange_squared_norms(comm, shard.servers, shard.server, mine, step)
        factor = norm_factor(total, clip.value)
        for grad, _ in grads.values():
            grad.mul_(factor)
    for b, (grad, used) in grads.items():
        if clip is not None and clip.algorithm == "value":
            clip_value(grad, clip)
        if b not in applied:
            shard.apply(b, grad, used)


def synchronous_step(
    comm: Communicator, shard: ShardOptimizer, step: int, replicate: Replicate | None = None,
    applied: frozenset[int] = frozenset(),
) -> None:  # fmt: skip
    """Wait for every worker's push of a bucket, average, apply, send the slices back.

    Bucket by bucket, so the first buckets' weights go back while later pushes arrive;
    clipping by norm needs the whole gradient's norm, so it waits for every bucket first.
    ``replicate(bucket, grad, used)`` (``fault_tolerant``) hands each applied update to the
    shard's backup before the slices go back; buckets ``applied`` already (by a lost
    primary, replicated) are not applied again."""
    workers = shard.spec.num_workers
    pushes = {b: [shard.push_buffer(b) for _ in range(workers)] for b in shard.active}
    tag = shard.tag(Kind.PUSH)
    recvs = {
        b: [comm.irecv(buf, w, step=step, chunk=b, tag=tag) for w, buf in enumerate(bufs)]
        for b, bufs in pushes.items()
    }
    whole = shard.spec.clip is not None and shard.spec.clip.algorithm == "norm"
    sends, waiting = [], {}
    for b in shard.active:
        total = recvs[b][0].wait().clone()
        for handle in recvs[b][1:]:
            total += handle.wait()  # worker order: the same sum every run
        grad, used = shard.decode_push(b, total)
        waiting[b] = (grad.div_(workers), used)
        if whole:
            continue
        apply_averaged(comm, shard, waiting, step, applied)
        _replicate(replicate, waiting, applied)
        sends += shard.send_slices(comm, b, range(workers), step)
        waiting = {}
    if whole:
        apply_averaged(comm, shard, waiting, step, applied)
        _replicate(replicate, waiting, applied)
        sends += [h for b in shard.active for h in shard.send_slices(comm, b, range(workers), step)]
    wait_all(sends)


Replicate = Callable[[int, torch.Tensor, torch.Tensor], None]


def _replicate(replicate: Replicate | None, grads: dict[int, tuple[torch.Tensor, torch.Tensor]],
               applied: frozenset[int]) -> None:  # fmt: skip
    for b, (grad, used) in grads.items():
        if replicate is not None and b not in applied:
            replicate(b, grad, used)


StepRule = Callable[[Communicator, ShardOptimizer, int], None]


def serve(comm: Communicator, server: int, rule: StepRule = synchronous_step) -> None:
    """Run server ``server`` (group rank ``W + server``) until the workers send ``STOP``."""
    role = f"parameter server {server} (rank {comm.rank})"
    try:
        spec: ServerSpec | None = recv_object(comm, 0, protocol.decode_spec, IDLE_TIMEOUT)
        if spec is None:  # nothing to train (validate/test/predict)
            return
        shard = ShardOptimizer(spec, server)
        shard.share_initial(comm)
        while True:
            header = recv_headers(comm, spec.num_workers, spec.num_hyper, IDLE_TIMEOUT)[0]
            if header.command == Command.STOP:
                return
            if header.command == Command.STEP:
                shard.set_hyper(list(header.hyper))
                rule(comm, shard, header.step)
            elif header.command == Command.GET_STATE:
                send_object(comm, shard.state_slices(), 0)
            elif header.command == Command.SET_STATE:
                shard.load_full(recv_object(comm, 0, protocol.decode_state))
            else:
                raise ProtocolError(
                    f"{role}: command {header.command.name} is for the asynchronous server"
                )
    except CommError as err:
        raise CommError(f"{role}: {err} (ranks 0..W-1 are the workers, W.. the servers)") from err
