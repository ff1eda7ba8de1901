"""The user's own network, run as pipeline stages in place (any ``nn.Module``, no Lightning).

:class:`PipelinedNetwork` takes a network cut by :func:`lightning_par.graphcut.split_module`
and makes it run as this device's stages of the pipeline *without replacing it*: the
network keeps its type, attributes, indexing (``net.layer1``, ``net[0]``), parameter names
and state-dict keys. Only two things change on each device:

* the parameters and buffers no stage of this device uses are emptied (their storage is
  released, ``p.data`` becomes an empty tensor; the ``Parameter`` objects stay, so an
  optimiser built over the whole network simply never steps them), so each device holds
  about ``1/K`` of the weights (measured in ``benchmarks/``);
* ``net.forward`` runs the pipeline: every device calls it with the same batch inside a
  training/validation/... step; the device holding the first stage feeds the micro-batches
  in, the last one's joined output is sent to every device and returned there, so the
  user's loss, metrics and logging run unchanged on real values.

Training under GPipe: ``forward`` runs the forward steps of the schedule and returns the
output as a leaf; the user's ``loss.backward()`` fills its gradient, then :meth:`backward`
runs the backward steps with it, cut per micro-batch (as
:class:`~lightning_par.pipeline.sequential.PipelinedSequential`). Under the schedules that
need the loss per micro-batch (1F1B, interleaved, zero bubble), ``forward`` runs the whole
schedule at once with ``loss_fn(output_i, target_i)`` per micro-batch (:meth:`expect`
gives the target and the loss) and :meth:`backward` hands over the gradients it computed.

Tied parameters (used by stages on several devices, e.g. an embedding shared with the
output layer) are held by every device that uses them; after each backward their gradients
are summed over the devices (DeepSpeed's ``TiedLayerSpec``), so the copies stay equal.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_par.comm import Communicator
from lightning_par.graphcut import GraphSplit, nested
from lightning_par.pipeline import batch_dims as bd
from lightning_par.pipeline.materialize import has_meta, materialize
from lightning_par.pipeline.messages import HEADER_LEN, Kind, read_header, write_header
from lightning_par.pipeline.microbatch import micro_batch_sizes
from lightning_par.pipeline.multistage import DeviceStages
from lightning_par.pipeline.schedules import GPIPE, Schedule, get_schedule
from lightning_par.pipeline.step import checked_schedule

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PipelinedNetwork:
    """This device's stages of ``net`` (cut as ``split``), installed as ``net.forward``.

    Args:
        net: the user's network (every device holds it whole until this call).
        split: ``net`` cut into ``K * virtual_stages`` stages; device ``d`` runs stages
            ``d, d + K, ...``.
        comm: the devices' communicator (device = group rank).
        chunks: micro-batches per batch; ``schedule`` (a :class:`~.schedules.Schedule` or its
            name), ``virtual_stages``, ``checkpoint``: see :mod:`.schedules` and
            :mod:`.checkpoint`.
        input_dims, output_dims: the batch dimension of each input and output tensor
            (:mod:`.batch_dims`); ``None``: inputs found per call, outputs along 0.

    Inputs and outputs may be tuples/lists (nested) of tensors (:mod:`~lightning_par.graphcut.
    nested`): an LSTM's ``hidden``, cut into micro-batches along its own batch dimension.
    """

    def __init__(
        self,
        net: nn.Module,
        split: GraphSplit,
        comm: Communicator,
        *,
        chunks: int,
        schedule: Schedule | str = GPIPE,
        virtual_stages: int = 1,
        checkpoint: str = "never",
        input_dims: bd.Dims | None = None,
        output_dims: bd.Dims | None = None,
    ) -> None:
        k = comm.world_size
        if len(split) != k * virtual_stages:
            raise ValueError(f"{len(split)} stages for {k} devices x {virtual_stages}")
        self.net, self.comm, self.chunks = net, comm, chunks
        self.schedule, self.virtual_stages = get_schedule(schedule), virtual_stages
        mine = {s.index: s.module for s in split.stages if s.index % k == comm.rank}
        self.stages = DeviceStages(
            mine, len(split), comm, split_backward=self.schedule.split_backward,
            checkpoint=checkpoint,
        )  # fmt: skip
        self.is_first, self.is_last = 0 in mine, len(split) - 1 in mine
        self.input_names = split.stages[0].inputs
        self.input_structures = split.input_structures or (None,)
        self.output_structure = split.output_structure
        self.input_dims, self.output_dims = input_dims, output_dims
        self._signature = inspect.signature(net.forward)
        used = {id(t) for m in mine.values() for t in [*m.parameters(), *m.buffers()]}
        self.local_names = {n for n, t in _tensors(net) if id(t) in used}
        self.holders = _holders(net, split, k)  # tied parameter name -> devices holding it
        self.tied_shapes = {n: p.shape for n, p in net.named_parameters() if n in self.holders}
        shapes = {n: t.shape for n, t in _tensors(net)}
        self.active = False
        #: traces the network again for new micro-batch inputs (None: shapes never baked in)
        self.recut: Callable[[tuple], GraphSplit] | None = None
        self._cuts: dict[tuple, dict[int, nn.Module]] = {}
        self._output_shapes: dict[tuple, list[tuple[torch.Size, torch.dtype]]] = {}
        self._traced_for: tuple | None = None
        self._pending: tuple[list, list[torch.Tensor]] | None = None
        self._precomputed: torch.Tensor | None = None
        self._stash: list[tuple[nn.Parameter, torch.Tensor | None]] | None = None
        self._loss: tuple[torch.Tensor, LossFn, float] | None = None
        #: the last scheduled step's batch loss (size-weighted mean of the micro-batches'
        #: ``loss_fn``, before ``scale``) on the device holding the last stage; else None
        self.last_loss: torch.Tensor | None = None
        if has_meta(net):  # built on the meta device: storage for this device's stages only
            real = [t.device for _, t in _tensors(net) if not t.is_meta]
            materialize(net, self.local_names, real[0] if real else "cpu")
        _release(net, self.local_names)
        #: id(tensor) -> shape before release (to trace the network again: graphcut's sizes)
        self.full_shapes = {id(t): shapes[n] for n, t in _tensors(net)}
        net.forward = self.forward  # type: ignore[method-assign]  # the instance's, not the class's

    # ---- what this device holds ---------------------------------------------------------------
    def local_parameters(self) -> list[nn.Parameter]:
        """The parameters this device's stages use (tied ones included)."""
        return [p for n, p in self.net.named_parameters() if n in self.local_names]

    def counted_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients this device counts in a global norm: its own, and a
        tied one only on the first device that holds it."""
        first = {n for n, devices in self.holders.items() if devices[0] != self.comm.rank}
        return [p for n, p in self.net.named_parameters() if n in self.local_names - first]

    # ---- forward -----------------------------------------------------------------------------
    def expect(self, target: torch.Tensor, loss_fn: LossFn, scale: float = 1.0) -> None:
        """The next training forward runs the whole schedule with ``loss_fn`` per micro-batch
        (schedules past GPipe); its gradients are scaled by ``scale``."""
        self._loss = (target, loss_fn, scale)

    def _inputs(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, ...]:
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        k = len(self.input_structures)
        values = list(bound.arguments.values())[:k]
        extra = [
            n
            for n, v in list(bound.arguments.items())[k:]
            if v is not self._signature.parameters[n].default
        ]
        alike = [nested.travels(v) and nested.structure_of(v) == s
                 for v, s in zip(values, self.input_structures)]  # fmt: skip
        if extra or len(values) < k or not all(alike):
            raise TypeError(
                f"the pipelined network was cut for the inputs ({', '.join(self.input_names)}), "
                f"all tensors; it was called with {', '.join(bound.arguments)}"
            )
        return tuple(t for v in values for t in nested.flatten(v)[0])

    def _structured(self, leaves: tuple[torch.Tensor, ...]) -> tuple:
        """The network's arguments holding the input tensors ``leaves`` (the inverse of
        :meth:`_inputs`)."""
        it, args = iter(leaves), []
        for structure in self.input_structures:
            args.append(nested.unflatten([next(it) for _ in range(nested.count(structure))],
                                         structure))  # fmt: skip
        return tuple(args)

    def _rebuilt(self, leaves: list[torch.Tensor]) -> Any:
        """The network's output holding the output tensors ``leaves``."""
        if self.output_structure is None:
            return leaves[0]
        return nested.unflatten(leaves, self.output_structure)

    def _in_dims(self, xs: tuple[torch.Tensor, ...]) -> bd.Dims:
        dims = self.input_dims if self.input_dims is not None else bd.input_dims(xs)
        bd.check_inputs(xs, dims)
        return dims

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._precomputed is not None:
            out, self._precomputed = self._precomputed, None
            return out
        if not self.active:
            raise RuntimeError(
                "this network is split into pipeline stages over processes; it can only run "
                "inside the Trainer's training/validation/test/predict steps, where every stage "
                "calls it with the same batch"
            )
        if self._pending is not None:  # a previous step never ran backward: drop it
            self._pending = None
            self.stages.finish()
        xs = self._inputs(args, kwargs)
        dims = self._in_dims(xs)
        chunks = min(self.chunks, xs[0].shape[0])
        self._stages_for(xs, dims, chunks)
        training = torch.is_grad_enabled()
        if training and self.schedule.loss_per_micro_batch:
            return self._run_scheduled(xs, dims, chunks)
        # forwards only (evaluation): any schedule's forward steps, in its order
        schedule = GPIPE if training else self.schedule
        steps = checked_schedule(schedule, self.comm.world_size, chunks, self.virtual_stages)
        steps = steps[self.comm.rank]
        self.stages.begin(tuple(xs[0].shape), chunks)
        feed = bd.scatter_inputs(xs, dims, chunks) if self.is_first else None
        self.stages.run([s for s in steps if s.op == "fwd"], feed)
        outs = self._share(self._joined(chunks))
        if not training:
            self.stages.finish()
            return self._rebuilt(outs)
        leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in outs]
        self._pending = ([s for s in steps if s.op != "fwd"], leaves)
        return self._rebuilt(leaves)

    def _stages_for(self, xs: tuple[torch.Tensor, ...], dims: bd.Dims, chunks: int) -> None:
        """The stages traced for these micro-batches' shapes: a network whose code reads
        shapes (``x.view(b, ...)``) is traced again for each new shape, as torch's pipelining
        traces one micro-batch shape; its micro-batches must then all have that shape."""
        if self.recut is None:
            return
        sizes = set(micro_batch_sizes(xs[0].shape[0], chunks))
        if len(sizes) > 1:
            raise ValueError(
                f"a batch of {xs[0].shape[0]} does not split into {chunks} equal micro-batches, "
                "and this network was traced for one micro-batch shape: use a batch size "
                f"divisible by chunks={chunks} (drop_last=True for the last batch)"
            )
        key = _shape_key(xs, dims, sizes.pop())
        if key == self._traced_for:
            return
        if key not in self._cuts:
            micro = bd.first_samples(xs, dims, key[-1])
            split = self.recut(self._structured(micro))
            self._cuts[key] = {s: split.stages[s].module for s in self.stages.stages}
        self.stages.stages.update(self._cuts[key])
        self._traced_for = key

    def traced_at(self, example: tuple[torch.Tensor, ...]) -> None:
        """The stages were cut for micro-batches like ``example``: no new trace for those."""
        dims = self.input_dims if self.input_dims is not None else bd.input_dims(example)
        key = _shape_key(example, dims, example[0].shape[0])
        self._cuts[key] = dict(self.stages.stages)
        self._traced_for = key

    def rebind(self, comm: Communicator) -> None:
        """Use ``comm`` from now on (a new Trainer's process group, same ranks)."""
        if (comm.world_size, comm.rank) != (self.comm.world_size, self.comm.rank):
            raise ValueError(
                f"this network was split over {self.comm.world_size} devices in an earlier "
                f"run and cannot run as device {comm.rank} of {comm.world_size}: build the "
                "model again"
            )
        self.comm = self.stages.comm = comm

    def _out_dims(self, count: int) -> bd.Dims:
        return self.output_dims if self.output_dims is not None else (0,) * count

    def _joined(self, chunks: int) -> list[torch.Tensor] | None:
        """The last device's output tensors, each joined along its batch dimension."""
        if not self.is_last:
            return None
        results = [self.stages.results[i] for i in range(chunks)]
        return bd.gather_outputs(results, self._out_dims(len(results[0])))

    def _run_scheduled(self, xs: tuple[torch.Tensor, ...], dims: bd.Dims, chunks: int) -> Any:
        if self._loss is None:
            raise RuntimeError(
                f"schedule={self.schedule.name!r} computes the loss per micro-batch: "
                "call expect(target, loss_fn) before the forward"
            )
        target, loss_fn, scale = self._loss
        self._loss, self.last_loss, losses = None, None, []
        k, rank = self.comm.world_size, self.comm.rank
        steps = checked_schedule(self.schedule, k, chunks, self.virtual_stages)[rank]
        batch = xs[0].shape[0]
        sizes = micro_batch_sizes(batch, chunks)
        targets = _split_target(target, sizes) if self.is_last else []

        def output_grad(i: int, outs: tuple[torch.Tensor, ...]) -> list[torch.Tensor | None]:
            leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in outs]
            loss = loss_fn(self._rebuilt(leaves), targets[i]) * (sizes[i] / batch)
            losses.append(loss.detach())
            wanted = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad(loss * scale, wanted, allow_unused=True))
            return [next(grads) if t.requires_grad else None for t in leaves]

        # Lightning zeroes the gradients between training_step and backward: keep this step's
        # aside and hand them over in backward()
        params = [p for p in self.local_parameters() if p.requires_grad]
        before = [p.grad for p in params]
        for p in params:
            p.grad = None
        self.stages.begin(tuple(xs[0].shape), chunks)
        feed = bd.scatter_inputs(xs, dims, chunks) if self.is_first else None
        self.stages.run(steps, feed, output_grad=output_grad)
        if losses:
            self.last_loss = torch.stack(losses).sum()
        outs = self._share(self._joined(chunks))
        self.stages.finish()
        self._stash = [(p, p.grad) for p in params]
        for p, grad in zip(params, before):
            p.grad = grad
        return self._rebuilt([t.detach().requires_grad_(t.is_floating_point()) for t in outs])

    def _share(self, outs: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """The last device's joined output tensors, on every device: traced messages (tag
        ``OUTPUT``), after a header the first time a batch shape is seen (both ends cache it,
        as the activations' headers)."""
        k, last = self.comm.world_size, self.comm.world_size - 1  # stage S - 1 is on K - 1
        if k == 1:
            assert outs is not None
            return outs
        meta = {"step": self.stages.step_index, "chunk": -1}
        device = self.stages._device()
        key = self.stages._key
        if self.is_last:
            assert outs is not None
            outs = [t.detach().contiguous() for t in outs]
            handles = []
            if key not in self._output_shapes:
                header = write_header(tuple(outs)).to(device)
                handles += [
                    self.comm.isend(header, d, tag=Kind.HEADER, **meta) for d in range(last)
                ]
                self._output_shapes[key] = [(t.shape, t.dtype) for t in outs]
            handles += [self.comm.isend(t, d, tag=Kind.OUTPUT, **meta)
                        for d in range(last) for t in outs]  # fmt: skip
            for handle in handles:
                handle.wait()
            return outs
        if key not in self._output_shapes:
            header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
            header = self.comm.recv(header, last, tag=Kind.HEADER, **meta)
            self._output_shapes[key] = read_header(header.cpu())
        return [
            self.comm.recv(torch.empty(shape, dtype=dtype, device=device), last,
                           tag=Kind.OUTPUT, **meta)
            for shape, dtype in self._output_shapes[key]
        ]  # fmt: skip

    # ---- backward ----------------------------------------------------------------------------
    def backward(self) -> None:
        """After the user's ``loss.backward()``: GPipe's backward steps with the gradient the
        loss left on the output, or the gradients the scheduled forward computed; then the
        tied parameters' gradients summed over the devices holding them."""
        if self._stash is not None:
            for param, grad in self._stash:
                if grad is not None:
                    param.grad = grad if param.grad is None else param.grad.add_(grad)
            self._stash = None
        elif self._pending is not None:
            steps, leaves = self._pending
            self._pending = None
            grads = self._output_grads(leaves) if self.is_last else []

            def output_grad(i: int, outs: tuple[torch.Tensor, ...]) -> list[torch.Tensor | None]:
                return [g[i] for g in grads]

            self.stages.run(steps, output_grad=output_grad)
            self.stages.finish()
        self.sum_tied_gradients()

    def _output_grads(self, leaves: list[torch.Tensor]) -> list[list[Any]]:
        """Per output tensor, the gradient the user's loss left on it (zero if none) cut into
        the micro-batches' along its batch dimension (``None`` for integer outputs)."""
        results = [self.stages.results[i] for i in range(len(self.stages.results))]
        grads = []
        for j, (leaf, d) in enumerate(zip(leaves, self._out_dims(len(leaves)))):
            if not leaf.requires_grad:
                grads.append([None] * len(results))
                continue
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            grads.append(bd.split_output_grad(grad, d, [r[j].shape[d or 0] for r in results]))
        return grads

    def sum_tied_gradients(self) -> None:
        """Each tied parameter's gradient becomes the sum over the devices that use it (an
        allreduce over the pipeline's devices: the others add zeros)."""
        if not self.holders or self.comm.world_size == 1:
            return
        params = dict(self.net.named_parameters())
        for name in sorted(self.holders):
            p = params[name]
            if not p.requires_grad:
                continue
            mine = name in self.local_names and p.grad is not None
            grad = (
                p.grad
                if mine
                else torch.zeros(self.tied_shapes[name], dtype=p.dtype, device=p.device)
            )
            dist.all_reduce(grad, group=self.comm.group)
            if name in self.local_names and p.grad is None:  # its stages had no gradient
                p.grad = grad


def _shape_key(xs: tuple[torch.Tensor, ...], dims: bd.Dims, size: int) -> tuple:
    """The shapes (without the batch dimension) and dtypes of inputs, and the micro-batch
    size: one traced cut serves every batch with this key."""
    shapes = tuple(
        (tuple(s for i, s in enumerate(t.shape) if i != d), t.dtype) for t, d in zip(xs, dims)
    )
    return shapes + (size,)


def _split_target(target: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """The target of each micro-batch, cut along its batch dimension (:mod:`.batch_dims`)."""
    n = sum(sizes)
    d = bd.batch_dim(target, n) if isinstance(target, torch.Tensor) else None
    if d is None:
        raise ValueError(
            f"the target ({nested.describe(target)} of shape "
            f"{tuple(getattr(target, 'shape', ()))}) has no dimension of the batch size {n}: "
            "the loss per micro-batch needs a target tensor holding one row per sample"
        )
    return list(target.split(sizes, dim=d))


def _tensors(net: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from net.named_parameters(remove_duplicate=False)
    yield from net.named_buffers(remove_duplicate=False)


def _holders(net: nn.Module, split: GraphSplit, k: int) -> dict[str, tuple[int, ...]]:
    """Tied parameters (by the network's name) -> the devices whose stages use them."""
    named = {id(p): n for n, p in net.named_parameters()}
    out = {}
    for stage_name, stages in split.shared.items():
        param = split.stages[stages[0]].module.get_parameter(stage_name)
        devices = tuple(sorted({s % k for s in stages}))
        if len(devices) > 1:
            out[named[id(param)]] = devices
    return out


def _release(net: nn.Module, keep: set[str]) -> None:
    """Empty every parameter and buffer of ``net`` not named in ``keep`` (storage freed)."""
    for name, t in list(_tensors(net)):
        if name not in keep and t.numel():
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
