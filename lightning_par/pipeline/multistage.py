"""The pipeline runtime: the stages one device holds, and the loop that runs its steps.

:class:`DeviceStages` is the package's one stage runtime. It runs any step list of
:mod:`.schedule` and :mod:`.schedules_v`: GPipe and 1F1B (one stage per device), interleaved
1F1B (device ``d`` holds stages ``d, d+K, ...``) and zero bubble (the backward split into an
input-gradient step B and a weight-gradient step W, :mod:`.weight_grads`). The strategies'
networks (:mod:`.network`), the RNN wavefront (:mod:`lightning_par.modelparallel.wavefront`,
time chunks in place of micro-batches), the benchmark and the course all run on it, as
torch's pipelining runs every schedule on one ``PipelineStage``.

**Stage interface.** A stage is a module mapping a tuple of tensors to a tuple of tensors
(``stage(*inputs) -> tuple``; a single tensor is read as a 1-tuple both ways), so a cut
where several tensors cross (a skip connection, an attention mask) is one message of a
tuple. Stage 0 receives the micro-batch as a tuple; stage ``s+1`` receives stage ``s``'s
output tuple. Floating-point tensors carry gradients back (a zero gradient where the
forward did not use an input); integer and boolean ones only travel forward. Each tensor of
a tuple is one message; a header (count, dtypes, shapes) precedes the first message of
each (batch shape, micro-batch, stage) and both ends cache it.

**Messages.** Per (peer, kind) messages are matched in order (the transport tag is the
kind, :class:`~.messages.Kind`), which :func:`lightning_par.pipeline.validate.validate`
checks the schedule respects; sends are asynchronous and complete at
:meth:`DeviceStages.finish`. Receives are posted ahead of the compute that needs them
(:mod:`.receives`), into buffers kept from step to step.

**Re-materialisation** (:mod:`.checkpoint`, torchgpipe's modes) keeps only a stage's input
per micro-batch and runs its forward again in the backward; the B/W split refuses it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_par.comm import Communicator, Event, Handle
from lightning_par.pipeline.checkpoint import SavedActivations, check_mode, recomputes
from lightning_par.pipeline.messages import Kind, Tensors, as_tuple, write_header
from lightning_par.pipeline.receives import ReceiveAhead
from lightning_par.pipeline.schedule import Step
from lightning_par.pipeline.weight_grads import WeightGrads

#: last stage: the gradients of the loss w.r.t. micro-batch i's outputs
OutputGrad = Callable[[int, Tensors], Sequence[torch.Tensor | None]]


class DeviceStages(ReceiveAhead):
    """The stages one device holds, and the loop that runs its steps.

    Args:
        stages: ``{stage index: module}`` for this device's stages.
        num_stages: stages of the whole model, ``S``.
        comm: the devices' communicator (device = group rank).
        device_of: which device holds a stage (default: round-robin, ``s % K``).
        split_backward: prepare the B/W split (zero bubble); refuses tied parameters.
        checkpoint: re-materialisation (:mod:`.checkpoint`'s modes; ``"never"`` with the split).
    """

    def __init__(self, stages: dict[int, nn.Module], num_stages: int, comm: Communicator, *,
                 device_of: Callable[[int], int] | None = None, split_backward: bool = False,
                 checkpoint: str = "never") -> None:  # fmt: skip
        self.stages, self.num_stages, self.comm = dict(stages), num_stages, comm
        self.device_of = device_of or (lambda s: s % comm.world_size)
        for s in self.stages:
            if self.device_of(s) != comm.rank:
                raise ValueError(f"device {comm.rank} was given stage {s}, which lives on "
                                 f"device {self.device_of(s)}")  # fmt: skip
        self.checkpoint = check_mode(checkpoint)
        if split_backward and checkpoint != "never":
            raise ValueError(
                f"checkpoint={checkpoint!r} with the B/W split (zero bubble): re-materialising "
                "would recompute each forward for B and again for W; use checkpoint='never'"
            )
        self.weights = WeightGrads(self.stages) if split_backward else None
        self.step_index, self.chunks = 0, 0
        self.saved: SavedActivations | None = None  # set by measure_memory()
        #: Called just before the step's last parameter-gradient step (``bwd`` or
        #: ``bwd_weight``), after which every gradient is complete (hybrid parallelism
        #: starts its data-parallel buckets then).
        self.before_last_backward: Callable[[], None] | None = None
        self._shapes: dict[tuple, list[tuple[torch.Size, torch.dtype]]] = {}
        self._output_shapes: dict[tuple, list[tuple[torch.Size, torch.dtype]]] = {}
        self._local: dict[tuple[Kind, int, int], Tensors] = {}
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._reset()

    def _reset(self) -> None:
        self._inputs: dict[tuple[int, int], Tensors] = {}
        self._outputs: dict[tuple[int, int], Tensors] = {}
        self._sends: list[Handle] = []
        self._posted: dict[tuple[Kind, tuple[int, int]], list[Handle]] = {}
        self._queues: dict[Kind, list[tuple[int, int]]] = {}
        self._gradient_steps = 0
        self.results: dict[int, Tensors] = {}  # last stage: detached outputs per micro-batch
        if self.weights is not None:
            self.weights.reset()

    @property
    def is_first(self) -> bool:
        """Whether this device holds stage 0 (it feeds the micro-batches in)."""
        return 0 in self.stages

    @property
    def is_last(self) -> bool:
        """Whether this device holds the last stage (it computes the loss)."""
        return self.num_stages - 1 in self.stages

    @property
    def device(self) -> torch.device:
        """Where received tensors go: the device of the stages' parameters."""
        for module in self.stages.values():
            for p in module.parameters():
                return p.device
        return torch.device("cpu")

    def measure_memory(self) -> None:
        """Count activation bytes saved for backward from the next step on (:attr:`saved`:
        ``peak`` is the most this device held at once, all its stages together)."""
        params = [p for m in self.stages.values() for p in m.parameters()]
        self.saved = SavedActivations(exclude=params)

    def begin(self, batch_shape: Sequence, chunks: int) -> None:
        """Start a step of ``chunks`` micro-batches; ``batch_shape`` (equal on every device:
        the batch's shape, and whatever else fixes the messages' shapes) keys the cached
        headers."""
        self._reset()
        if self.saved is not None:
            self.measure_memory()
        self.chunks = chunks
        self._key = (tuple(batch_shape), chunks)
        self._start = self.comm.trace.now() if self.comm.trace is not None else 0.0

    def finish(self) -> None:
        """Wait for this step's sends; record the step span; drop the step's state."""
        for handle in self._sends:
            handle.wait()
        if self.comm.trace is not None:
            self.comm.trace.events.append(
                Event(self.comm.rank, "step", self._start, self.comm.trace.now(), self.step_index)
            )
        self._reset()
        self.step_index += 1

    def joined_output(self) -> torch.Tensor:
        """Last stage: the first output tensor of every micro-batch, joined along dim 0."""
        return torch.cat([self.results[i][0] for i in range(self.chunks)])

    def _span(self, name: str, i: int):
        trace = self.comm.trace
        return trace.span(name, micro_batch=i) if trace is not None else contextlib.nullcontext()

    # ---- steps ----------------------------------------------------------------------------
    def run(self, steps: Sequence[Step], inputs: Sequence[Tensors] | None = None,
            output_grad: OutputGrad | None = None) -> None:  # fmt: skip
        """Run ``steps`` in order; ``inputs[i]``: micro-batch i (needed if this device holds
        stage 0); ``output_grad``: needed if it holds the last stage and runs backwards."""
        self._queues = queues = self._receive_queues(steps)
        self._post_ready(queues)
        for step in steps:
            key = (step.stage, step.micro_batch)
            if step.op in ("bwd", "bwd_weight"):
                self._gradient_step()
            if step.op == "fwd":
                self._forward(key, inputs)
            elif step.op == "bwd_weight":
                with self._span("bwd_weight", step.micro_batch):
                    self._split().run(key)
            else:
                self._backward(key, output_grad, split=step.op == "bwd_input")
            self._post_ready(queues)

    def _gradient_step(self) -> None:
        self._gradient_steps += 1
        last = self._gradient_steps == self.chunks * len(self.stages)
        if last and self.before_last_backward is not None:
            self.before_last_backward()

    def _split(self) -> WeightGrads:
        if self.weights is None:
            raise ValueError("a schedule with a split backward (bwd_input, bwd_weight) runs on "
                             "DeviceStages(..., split_backward=True)")  # fmt: skip
        return self.weights

    def _forward(self, key: tuple[int, int], inputs: Sequence[Tensors] | None) -> None:
        s, i = key
        grad = torch.is_grad_enabled()
        if s == 0:
            if inputs is None:
                raise ValueError("the device holding stage 0 needs the micro-batches as `inputs`")
            x = as_tuple(inputs[i], s)
        else:
            x = self._receive(Kind.ACT, s - 1, key)
            if grad:
                x = tuple(t.requires_grad_(True) if t.is_floating_point() else t for t in x)
        recompute = grad and recomputes(self.checkpoint, i, self.chunks)
        none = contextlib.nullcontext()
        hooks = self.saved.hooks() if self.saved is not None else none
        capture = self.weights.capture(key) if self.weights is not None else none
        with self._span("fwd", i), hooks, capture:
            if recompute:  # keep only the inputs; the backward runs the forward again
                out = as_tuple(checkpoint(self.stages[s], *x, use_reentrant=False), s)
            else:
                out = as_tuple(self.stages[s](*x), s)
        if recompute and self.saved is not None:  # the inputs it keeps to recompute from
            for t in x:
                self.saved.hold(t, out[0])
        if grad:
            self._inputs[key], self._outputs[key] = x, out
        if s == self.num_stages - 1:  # kept past the step: never a view of a kept buffer
            kept = {t.untyped_storage().data_ptr() for t in x} if s > 0 else set()
            self.results[i] = tuple(
                t.detach().clone() if t.untyped_storage().data_ptr() in kept else t.detach()
                for t in out
            )
        else:
            self._send(Kind.ACT, s + 1, key, tuple(t.detach() for t in out))

    def _backward(self, key: tuple[int, int], output_grad: OutputGrad | None, split: bool) -> None:
        s, i = key
        out = self._outputs.pop(key)
        if s == self.num_stages - 1:
            if output_grad is None:
                raise ValueError("the device holding the last stage needs `output_grad`")
            grads = tuple(output_grad(i, self.results[i]))
        else:  # one gradient per floating output, in order; integer outputs get none
            received = iter(
                self._receive(Kind.GRAD, s + 1, key, [t for t in out if t.is_floating_point()])
            )
            grads = tuple(next(received) if t.is_floating_point() else None for t in out)
        pairs = [(o, g) for o, g in zip(out, grads) if o.requires_grad and g is not None]
        x = self._inputs.pop(key)
        wanted = [t for t in x if t.requires_grad]
        with self._span("bwd_input" if split else "bwd", i):
            if not pairs:
                x_grads = [None] * len(wanted)
            elif split:
                x_grads = self._split().input_grads(
                    key, [o for o, _ in pairs], [g for _, g in pairs], wanted
                )
            else:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                x_grads = [t.grad for t in wanted] if s > 0 else []  # (stage 0 sends nothing)
        if s > 0:
            it = iter(x_grads)
            back = []
            for t in x:
                if t.is_floating_point():  # unused inputs get a zero gradient
                    g = next(it) if t.requires_grad else None
                    back.append(torch.zeros_like(t) if g is None else g)
            self._send(Kind.GRAD, s - 1, key, tuple(back))

    # ---- messages -------------------------------------------------------------------------
    def _send(self, kind: Kind, to_stage: int, key: tuple[int, int], tensors: Tensors) -> None:
        dst = self.device_of(to_stage)
        meta = {"step": self.step_index, "chunk": key[1]}
        if dst == self.comm.rank:  # the next stage is on this device (one device)
            self._local[(kind, to_stage, key[1])] = tensors
            return
        hkey = self._key + (kind, to_stage, key[1], "sent")
        if kind == Kind.ACT and hkey not in self._shapes:
            header = write_header(tensors).to(self.device)
            self._sends.append(self.comm.isend(header, dst, tag=Kind.HEADER, **meta))
            self._shapes[hkey] = [(t.shape, t.dtype) for t in tensors]
        for t in tensors:
            self._sends.append(self.comm.isend(t, dst, tag=kind, **meta))

    def share_output(self, outputs: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        """The device holding the last stage sends ``outputs`` (this step's joined output
        tensors; ``None`` elsewhere) to every other device, as traced messages of kind
        ``OUTPUT`` after a header the first time this step's shapes are seen (both ends cache
        it); returns them on every device, so each runs the user's loss on real values."""
        k, last = self.comm.world_size, self.device_of(self.num_stages - 1)
        meta = {"step": self.step_index, "chunk": -1}
        if self.comm.rank == last:
            assert outputs is not None
            outs = [t.detach().contiguous() for t in outputs]
            others, handles = [d for d in range(k) if d != last], []
            if others and self._key not in self._output_shapes:
                header = write_header(tuple(outs)).to(self.device)
                handles += [self.comm.isend(header, d, tag=Kind.HEADER, **meta) for d in others]
                self._output_shapes[self._key] = [(t.shape, t.dtype) for t in outs]
            handles += [self.comm.isend(t, d, tag=Kind.OUTPUT, **meta)
                        for d in others for t in outs]  # fmt: skip
            for handle in handles:
                handle.wait()
            return outs
        if self._key not in self._output_shapes:
            self._output_shapes[self._key] = self._receive_header(last, -1)
        return [
            self.comm.recv(torch.empty(shape, dtype=dtype, device=self.device), last,
                           tag=Kind.OUTPUT, **meta)
            for shape, dtype in self._output_shapes[self._key]
        ]  # fmt: skip
