"""The pipeline splitter's network: cut from its traced graph, run in place.

:class:`~lightning_par.components.pipeline_split.PipelineSplit` hands every network to
:class:`GraphPipeline` (an ``nn.Sequential`` is cut between its layers, each layer an
untraced call). Here the network is

1. found on the LightningModule (``module_attr``, or the one child module with parameters:
   :func:`~lightning_par.components.splitter.find_network`);
2. called once the way the user's code calls it, to learn its inputs: on
   ``module.example_input_array`` through ``module.forward``, or else on the first batch
   through the user's own step
   (:func:`~lightning_par.components.pipeline_inputs.capture_inputs`);
3. traced and cut (:func:`lightning_par.graphcut.split_module`, before the named modules or
   at points balanced by parameters or time), and run by
   :class:`~lightning_par.pipeline.network.PipelinedNetwork`, which keeps the user's module
   object (type, attributes, indexing, names) and empties what other devices hold.

Checkpoints hold the whole network under its own names on rank 0, and the optimiser state in
one process's format (every device's optimiser covers the whole parameter list, stepping
only what it holds), so they load without the strategy and resume under any other.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn

from lightning_par.comm import Communicator
from lightning_par.components import pipeline_inputs as inputs
from lightning_par.components.pipeline_inputs import capture_inputs
from lightning_par.graphcut import UnsplittableModel, auto_split_points, cut, trace
from lightning_par.pipeline.batchnorm import commit_batch_norm, defer_batch_norm
from lightning_par.pipeline.materialize import has_meta
from lightning_par.pipeline.network import PipelinedNetwork
from lightning_par.pipeline.schedules import Schedule
from lightning_par.pipeline.state import gather_objects


def _agree(comm: Communicator, points: list[str]) -> list[str]:
    """Rank 0's split points on every rank of ``comm`` (as JSON bytes, not pickle)."""
    if comm.world_size == 1:
        return points
    data = torch.tensor(list(json.dumps(points).encode()), dtype=torch.uint8)
    size = torch.tensor([data.numel()])
    dist.broadcast(size, comm.global_rank_of(0), group=comm.group)
    buf = data if comm.rank == 0 else torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(buf, comm.global_rank_of(0), group=comm.group)
    return json.loads(bytes(buf.tolist()).decode())


def try_cut(
    module: pl.LightningModule,
    attr: str,
    split_points: list[str] | None,
    stages: int,
    balance_by: str,
    who: str,
    trainer: pl.Trainer | None = None,
) -> None:
    """Before launch: trace and cut the network on ``example_input_array`` when the module has
    one, else on the first batch of its own data loader hook
    (:func:`~.pipeline_inputs.own_first_batch`), so that a network that cannot be split
    (a value that cannot travel between stages) is refused before any process starts."""
    net = getattr(module, attr)
    if type(net).forward is nn.Module.forward:  # ModuleList, ModuleDict: called piece by piece
        raise TypeError(
            f"{who} splits `{type(module).__name__}.{attr}`, a {type(net).__name__} without a "
            "forward of its own: hold the network as a module whose forward runs it (e.g. an "
            "nn.Sequential), or pass module_attr='<that module>'"
        )
    if _RUN_BY in net.__dict__:  # cut by an earlier run (fit twice, fit then test): reused as is
        return
    sample = getattr(module, "example_input_array", None)
    source = inputs.own_first_batch(module, trainer) if sample is None else None
    if sample is None and source is None or split_points is None and balance_by == "time":
        return
    if source is not None:  # the user's step may need what only a rank has: look, no more
        try:
            args, _ = capture_inputs(module, net, trainer, who, source)
        except ValueError:
            return
    try:
        if source is None:
            args, _ = capture_inputs(module, net, None, who)
        traced = trace(net, args)
        points = split_points or auto_split_points(net, traced, stages, "parameters", args)
        cut(traced, points)
    except (UnsplittableModel, ValueError) as error:
        raise ValueError(refusal(who, net, error)) from None


def refusal(who: str, net: nn.Module, error: Exception) -> str:
    """The message refusing to split ``net``, naming the strategy and the fix."""
    fix = ""
    if "would cross the cut" in str(error):
        fix = (" (split_points=[...] names the modules to cut before; e.g. before a module "
               "that takes the value whole)")  # fmt: skip
    return f"{who} cannot split {type(net).__name__}: {error}{fix}"


#: The attribute of a split network that holds its :class:`PipelinedNetwork`.
_RUN_BY = "_lightning_par_pipeline"


class GraphPipeline:
    """The network of ``module.<attr>`` cut into stages and run in place (see module doc)."""

    def __init__(
        self,
        module: pl.LightningModule,
        attr: str,
        comm: Communicator,
        *,
        split_points: list[str] | None,
        balance_by: str,
        chunks: int,
        schedule: Schedule,
        virtual_stages: int,
        checkpoint: str,
        deferred_batch_norm: bool,
        trainer: pl.Trainer | None,
        who: str,
    ) -> None:
        self.module, self.attr, self.comm = module, attr, comm
        self.deferred_batch_norm = deferred_batch_norm
        net = getattr(module, attr)
        earlier = net.__dict__.get(_RUN_BY)
        if earlier is not None:  # split by an earlier run (fit twice, fit then test)
            earlier.rebind(comm)
            self.network: PipelinedNetwork = earlier
            return
        stages = comm.world_size * virtual_stages
        if split_points is not None and len(split_points) + 1 != stages:
            raise ValueError(
                f"{who}: {len(split_points)} split points make {len(split_points) + 1} stages "
                f"but {comm.world_size} devices x {virtual_stages} need {stages}"
            )
        args = _positional(net, *capture_inputs(module, net, trainer, who))
        n = args[0].shape[0] if args and isinstance(args[0], torch.Tensor) and args[0].dim() else 1
        micro = -(-n // chunks)
        example, input_dims = inputs.micro_example(args, micro)
        if deferred_batch_norm:
            defer_batch_norm(net)
        # a Sequential is cut between its layers only: each layer stays a call, untraced, so
        # no shape inside it is fixed at the example's
        leaf = [n for n, _ in net.named_children()] if isinstance(net, nn.Sequential) else []
        traced = _refused_as_value_error(who, net, trace, net, example, leaf)
        points = split_points
        if points is None:
            by = "parameters" if balance_by == "params" else balance_by
            points = auto_split_points(net, traced, stages, by, example)
            if by == "time":  # measured: each rank's own timing would cut differently
                points = _agree(comm, points)
        split = _refused_as_value_error(who, net, cut, traced, points)
        output_dims = inputs.output_dims(net, args, traced, leaf) if micro < n else None
        self.split_points = list(points)
        if not has_meta(net):  # (a meta network is initialised alike on every device)
            _from_rank_0(net, comm)
        self.network = PipelinedNetwork(
            net, split, comm, chunks=chunks, schedule=schedule, virtual_stages=virtual_stages,
            checkpoint=checkpoint, input_dims=input_dims or None, output_dims=output_dims,
        )  # fmt: skip
        net.__dict__[_RUN_BY] = self.network
        if not leaf:  # a traced forward may fix shapes: traced again for new ones
            self.network.recut = functools.partial(_recut, net, self.network, points)
            self.network.traced_at(tuple(inputs.input_leaves(example)))

    @property
    def prefix(self) -> str:
        return f"{self.attr}."

    def after_backward(self) -> None:
        self.network.backward()
        if self.deferred_batch_norm:
            for stage in self.network.stages.stages.values():
                commit_batch_norm(stage)

    # ---- checkpoints -------------------------------------------------------------------------
    def held(self, local: dict[str, Any]) -> dict[str, Any]:
        """``local`` without the network's entries this device does not hold."""
        names = self.network.local_names
        return {
            k: v
            for k, v in local.items()
            if not k.startswith(self.prefix) or k[len(self.prefix) :] in names
        }

    def piece_state_dict(self, full: dict[str, Any]) -> dict[str, Any]:
        """``full`` with this device's empty tensors in place of what it does not hold."""
        mine = self.module.state_dict()
        return {k: (v if k in self.held({k: v}) else mine.get(k, v)) for k, v in full.items()}

    def full_optimizer_state(self, local: dict[str, Any], optimizer: Any) -> dict[str, Any]:
        """On rank 0: every parameter's state from the device holding it (all devices' optimisers
        list the same parameters in the same order), in one process's format."""
        opt = getattr(optimizer, "_optimizer", optimizer)
        held = {id(p) for p in self.network.local_parameters()}
        ids = [id(p) for g in opt.param_groups for p in g["params"]]
        states = local.get("state", {})
        mine = {i: s for i, s in states.items() if ids[i] in held}
        device = next((p.device for p in self.network.local_parameters()), torch.device("cpu"))
        everyone = gather_objects(self.comm, mine, device)
        if everyone is None:
            return {}
        merged: dict[int, Any] = {}
        for part in reversed(everyone):  # rank 0's copy of a tied parameter wins
            merged.update(part)
        return {**local, "state": dict(sorted(merged.items()))}

    def load_optimizer_states(self, optimizers: list[Any], states: list[Any]) -> None:
        """Each device loads the whole state, then drops what it does not hold."""
        held = {id(p) for p in self.network.local_parameters()}
        for optimizer, state in zip(optimizers, states):
            optimizer.load_state_dict(state)
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if id(p) not in held:
                        optimizer.state.pop(p, None)


def _positional(net: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """The captured call's inputs as positional arguments, in ``forward``'s order."""
    if not kwargs:
        return args
    names = list(inspect.signature(net.forward).parameters)
    return args + tuple(kwargs[n] for n in names[len(args) :] if n in kwargs)


def _refused_as_value_error(who: str, net: nn.Module, fn: Callable, *args: Any) -> Any:
    """``fn(*args)``, a network that cannot be traced or cut refused by :func:`refusal`."""
    try:
        return fn(*args)
    except UnsplittableModel as error:
        raise ValueError(refusal(who, net, error)) from None


def _from_rank_0(net: nn.Module, comm: Communicator) -> None:
    """Every device starts from rank 0's weights and buffers."""
    if comm.world_size == 1:
        return
    with torch.no_grad():
        for t in [*net.parameters(), *net.buffers()]:
            dist.broadcast(t.data, comm.global_rank_of(0), group=comm.group)


def _recut(net: nn.Module, network: PipelinedNetwork, points: list[str], micro: tuple) -> Any:
    """``net`` traced again for the micro-batch inputs ``micro`` and cut at ``points``."""
    own = net.__dict__.pop("forward")  # trace the network's own forward
    try:
        return cut(trace(net, micro, [], network.full_shapes), points)
    finally:
        net.forward = own  # type: ignore[method-assign]
