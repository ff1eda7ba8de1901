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

Every network runs this way, an ``nn.Sequential`` too (cut between its layers), on the one
stage runtime :class:`~lightning_par.pipeline.multistage.DeviceStages`.

Training under GPipe: ``forward`` runs the forward steps of the schedule and returns the
output as a leaf; the user's ``loss.backward()`` fills its gradient, then :meth:`backward`
runs the backward steps with it, cut per micro-batch. Under the schedules that need the loss
per micro-batch (1F1B, interleaved, zero bubble), ``forward`` runs the whole schedule at once
with ``loss_fn(output_i, target_i)`` per micro-batch (:meth:`expect` gives the target and
the loss) and :meth:`backward` hands over the gradients it computed.

Tied parameters (used by stages on several devices) are summed after each backward
(:mod:`.tied`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_par.comm import Communicator
from lightning_par.graphcut import GraphSplit
from lightning_par.pipeline import batch_dims as bd
from lightning_par.pipeline.materialize import has_meta, materialize, named_tensors, release
from lightning_par.pipeline.microbatch import micro_batch_sizes
from lightning_par.pipeline.multistage import DeviceStages
from lightning_par.pipeline.network_io import NetworkIO, shape_key, split_target
from lightning_par.pipeline.schedule import Step
from lightning_par.pipeline.schedules import GPIPE, Schedule, get_schedule
from lightning_par.pipeline.step import checked_schedule
from lightning_par.pipeline.tied import TiedParameters

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
            (:mod:`.network_io`).
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
        self.io = NetworkIO(net, split, input_dims, output_dims)
        used = {id(t) for m in mine.values() for t in [*m.parameters(), *m.buffers()]}
        self.local_names = {n for n, t in named_tensors(net) if id(t) in used}
        self.tied = TiedParameters(net, split, k)
        shapes = {n: t.shape for n, t in named_tensors(net)}
        self.active = False
        #: traces the network again for new micro-batch inputs (None: shapes never baked in)
        self.recut: Callable[[tuple], GraphSplit] | None = None
        self._cuts: dict[tuple, dict[int, nn.Module]] = {}
        self._traced_for: tuple | None = None
        self._pending: tuple[list[Step], list[torch.Tensor]] | None = None
        self._stash: list[tuple[nn.Parameter, torch.Tensor | None]] | None = None
        self._loss: tuple[torch.Tensor, LossFn, float] | None = None
        #: the last scheduled step's batch loss (size-weighted mean of the micro-batches'
        #: ``loss_fn``, before ``scale``) on the device holding the last stage; else None
        self.last_loss: torch.Tensor | None = None
        if has_meta(net):  # built on the meta device: storage for this device's stages only
            real = [t.device for _, t in named_tensors(net) if not t.is_meta]
            materialize(net, self.local_names, real[0] if real else "cpu")
        release(net, self.local_names)
        #: id(tensor) -> shape before release (to trace the network again: graphcut's sizes)
        self.full_shapes = {id(t): shapes[n] for n, t in named_tensors(net)}
        net.forward = self.forward  # type: ignore[method-assign]  # the instance's, not the class's

    # ---- what this device holds ---------------------------------------------------------------
    def local_parameters(self) -> list[nn.Parameter]:
        """The parameters this device's stages use (tied ones included)."""
        return [p for n, p in self.net.named_parameters() if n in self.local_names]

    def counted_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients this device counts in a global norm: its own, and a
        tied one only on the first device that holds it."""
        counted = self.local_names - self.tied.counted_elsewhere(self.comm.rank)
        return [p for n, p in self.net.named_parameters() if n in counted]

    def rebind(self, comm: Communicator) -> None:
        """Use ``comm`` from now on (a new Trainer's process group, same ranks)."""
        if (comm.world_size, comm.rank) != (self.comm.world_size, self.comm.rank):
            raise ValueError(
                f"this network was split over {self.comm.world_size} devices in an earlier "
                f"run and cannot run as device {comm.rank} of {comm.world_size}: build the "
                "model again"
            )
        self.comm = self.stages.comm = comm

    # ---- forward -----------------------------------------------------------------------------
    def expect(self, target: torch.Tensor, loss_fn: LossFn, scale: float = 1.0) -> None:
        """The next training forward runs the whole schedule with ``loss_fn`` per micro-batch
        (schedules past GPipe); its gradients are scaled by ``scale``."""
        self._loss = (target, loss_fn, scale)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.active:
            raise RuntimeError(
                "this network is split into pipeline stages over processes; it can only run "
                "inside the Trainer's training/validation/test/predict steps, where every stage "
                "calls it with the same batch"
            )
        if self._pending is not None:  # a previous step never ran backward: drop it
            self._pending = None
            self.stages.finish()
        xs = self.io.leaves(args, kwargs)
        dims = self.io.in_dims(xs)
        chunks = min(self.chunks, xs[0].shape[0])
        self._stages_for(xs, dims, chunks)
        training = torch.is_grad_enabled()
        if training and self.schedule.loss_per_micro_batch:
            return self._run_scheduled(xs, dims, chunks)
        # forwards only (evaluation): any schedule's forward steps, in its order
        steps = self._steps(GPIPE if training else self.schedule, chunks)
        self.stages.begin(tuple(xs[0].shape), chunks)
        feed = bd.scatter_inputs(xs, dims, chunks) if self.stages.is_first else None
        self.stages.run([s for s in steps if s.op == "fwd"], feed)
        outs = self.stages.share_output(self._joined(chunks))
        if not training:
            self.stages.finish()
            return self.io.rebuilt(outs)
        leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in outs]
        self._pending = ([s for s in steps if s.op != "fwd"], leaves)
        return self.io.rebuilt(leaves)

    def _steps(self, schedule: Schedule, chunks: int) -> list[Step]:
        k, rank = self.comm.world_size, self.comm.rank
        return checked_schedule(schedule, k, chunks, self.virtual_stages)[rank]

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
        key = shape_key(xs, dims, sizes.pop())
        if key == self._traced_for:
            return
        if key not in self._cuts:
            micro = bd.first_samples(xs, dims, key[-1])
            split = self.recut(self.io.structured(micro))
            self._cuts[key] = {s: split.stages[s].module for s in self.stages.stages}
        self.stages.stages.update(self._cuts[key])
        self._traced_for = key

    def traced_at(self, example: tuple[torch.Tensor, ...]) -> None:
        """The stages were cut for micro-batches like ``example``: no new trace for those."""
        dims = self.io.input_dims if self.io.input_dims is not None else bd.input_dims(example)
        key = shape_key(example, dims, example[0].shape[0])
        self._cuts[key] = dict(self.stages.stages)
        self._traced_for = key

    def _joined(self, chunks: int) -> list[torch.Tensor] | None:
        """The last device's output tensors, each joined along its batch dimension."""
        if not self.stages.is_last:
            return None
        results = [self.stages.results[i] for i in range(chunks)]
        return bd.gather_outputs(results, self.io.out_dims(len(results[0])))

    def _run_scheduled(self, xs: tuple[torch.Tensor, ...], dims: bd.Dims, chunks: int) -> Any:
        if self._loss is None:
            raise RuntimeError(
                f"schedule={self.schedule.name!r} computes the loss per micro-batch: "
                "call expect(target, loss_fn) before the forward"
            )
        target, loss_fn, scale = self._loss
        self._loss, self.last_loss, losses = None, None, []
        batch = xs[0].shape[0]
        sizes = micro_batch_sizes(batch, chunks)
        targets = split_target(target, sizes) if self.stages.is_last else []

        def output_grad(i: int, outs: tuple[torch.Tensor, ...]) -> list[torch.Tensor | None]:
            leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in outs]
            loss = loss_fn(self.io.rebuilt(leaves), targets[i]) * (sizes[i] / batch)
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
        feed = bd.scatter_inputs(xs, dims, chunks) if self.stages.is_first else None
        self.stages.run(self._steps(self.schedule, chunks), feed, output_grad=output_grad)
        if losses:
            self.last_loss = torch.stack(losses).sum()
        outs = self.stages.share_output(self._joined(chunks))
        self.stages.finish()
        self._stash = [(p, p.grad) for p in params]
        for p, grad in zip(params, before):
            p.grad = grad
        return self.io.rebuilt([t.detach().requires_grad_(t.is_floating_point()) for t in outs])

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
            grads = self._output_grads(leaves) if self.stages.is_last else []

            def output_grad(i: int, outs: tuple[torch.Tensor, ...]) -> list[torch.Tensor | None]:
                return [g[i] for g in grads]

            self.stages.run(steps, output_grad=output_grad)
            self.stages.finish()
        self.tied.sum_gradients(self.net, self.comm, self.local_names)

    def _output_grads(self, leaves: list[torch.Tensor]) -> list[list[Any]]:
        """Per output tensor, the gradient the user's loss left on it (zero if none) cut into
        the micro-batches' along its batch dimension (``None`` for integer outputs)."""
        results = [self.stages.results[i] for i in range(len(self.stages.results))]
        grads = []
        for j, (leaf, d) in enumerate(zip(leaves, self.io.out_dims(len(leaves)))):
            if not leaf.requires_grad:
                grads.append([None] * len(results))
                continue
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            grads.append(bd.split_output_grad(grad, d, [r[j].shape[d or 0] for r in results]))
        return grads
