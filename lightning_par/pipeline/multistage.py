"""One device of a pipeline that may hold several stages and split backwards into B and W.

:class:`DeviceStages` runs any step list of :mod:`.schedules_v` (and GPipe's and 1F1B's):
interleaved 1F1B, where device ``d`` holds stages ``d, d+K, ...``, and zero bubble, whose
backward is an input-gradient step B and a weight-gradient step W.

**Stage interface.** A stage is a module mapping a tuple of tensors to a tuple of tensors
(``stage(*inputs) -> tuple``; a single tensor is read as a 1-tuple both ways), so a cut
where several tensors cross (a skip connection, an attention mask) is one message of a
tuple. Stage 0 receives the micro-batch as a tuple; stage ``s+1`` receives stage ``s``'s
output tuple. Floating-point tensors carry gradients back (a zero gradient where the
forward did not use an input); integer and boolean ones only travel forward. Each tensor of
a tuple is one message; a header (count, dtypes, shapes) precedes the first message of
each (batch shape, micro-batch, stage) and both ends cache it.

**Messages.** Per (peer, kind) messages are matched in order (the transport tag is the
kind, :class:`Kind`), which :func:`lightning_par.pipeline.validate.validate` checks the
schedule respects; sends are asynchronous and complete at :meth:`DeviceStages.finish`.

**B/W split** (Qi et al., 2023, arXiv:2401.10241, section 2): B is
``torch.autograd.grad(outputs, inputs=stage inputs + the outputs of each module that owns
parameters, retain_graph=True)``: the stage input's gradient (sent at once) and, on the way,
the gradient w.r.t. each parameter-owning module's output, kept for W. W is then, per such
module, ``torch.autograd.backward(module output, its gradient, inputs=its own parameters)``,
which runs only that module's weight-gradient kernels (e.g. ``dW = dY^T X`` of a Linear),
not the input-gradient chain again. (Computing normalisation layers' weight gradients in B
instead saves about 10 % of the split's CPU on the CIFAR CNN, but their saved tensors then
stay until the step ends, doubling the peak activations: see benchmarks/pipeline.md.) Both
halves need the forward's saved activations, so re-materialisation
(``torch.utils.checkpoint``) would recompute the forward for B and again for W: the split
refuses checkpointing, and a parameter tied between two modules of one stage (whose W would
count the other module's path twice) is refused too.

**Receives** are posted ahead of the compute that needs them (:mod:`.receives`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_par.comm import Communicator, Event, Handle
from lightning_par.pipeline.checkpoint import SavedActivations, check_mode, recomputes
from lightning_par.pipeline.messages import HEADER_LEN, Kind, read_header, write_header
from lightning_par.pipeline.receives import ReceiveAhead
from lightning_par.pipeline.schedule import Step

Tensors = tuple[torch.Tensor, ...]
#: last stage: the gradients of the loss w.r.t. micro-batch i's outputs
OutputGrad = Callable[[int, Tensors], Sequence[torch.Tensor | None]]


def as_tuple(value: torch.Tensor | Sequence[torch.Tensor], stage: int) -> Tensors:
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in value):
        return tuple(value)
    raise TypeError(f"stage {stage} returned {type(value).__name__}: a stage maps a tuple of "
                    "tensors to a tensor or a tuple of tensors")  # fmt: skip


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
        self.step_index = 0
        self.saved: SavedActivations | None = None  # set by measure_memory()
        self._shapes: dict[tuple, list[tuple[torch.Size, torch.dtype]]] = {}
        self._owners: dict[int, list[nn.Module]] = {}
        if split_backward:
            for s, module in self.stages.items():
                self._owners[s] = _parameter_owners(module, s)
                for owner in self._owners[s]:
                    owner.register_forward_hook(self._capture)
        self._capturing: list | None = None
        self._local: dict[tuple[Kind, int, int], Tensors] = {}
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._reset()

    def _reset(self) -> None:
        self._inputs: dict[tuple[int, int], Tensors] = {}
        self._outputs: dict[tuple[int, int], Tensors] = {}
        self._captured: dict[tuple[int, int], list] = {}
        self._w_grads: dict[tuple[int, int], list] = {}
        self._sends: list[Handle] = []
        self._posted: dict[tuple[Kind, tuple[int, int]], list[Handle]] = {}
        self._queues: dict[Kind, list[tuple[int, int]]] = {}
        self.results: dict[int, Tensors] = {}  # last stage: detached outputs per micro-batch

    def _capture(self, module: nn.Module, args, output) -> None:
        if self._capturing is not None:
            for t in as_tuple(output, -1):
                if t.requires_grad:
                    self._capturing.append((module, t))

    def _device(self) -> torch.device:
        for module in self.stages.values():
            for p in module.parameters():
                return p.device
        return torch.device("cpu")

    def measure_memory(self) -> None:
        """Count activation bytes saved for backward from the next step on (:attr:`saved`:
        ``peak`` is the most this device held at once, all its stages together)."""
        params = [p for m in self.stages.values() for p in m.parameters()]
        self.saved = SavedActivations(exclude=params)

    def begin(self, batch_shape: Sequence[int], chunks: int) -> None:
        self._reset()
        if self.saved is not None:
            self.measure_memory()
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
            if step.op == "fwd":
                self._forward(key, inputs)
            elif step.op == "bwd_weight":
                with self._span("bwd_weight", step.micro_batch):
                    self._weight_grads(key)
            else:
                self._backward(key, output_grad, split=step.op == "bwd_input")
            self._post_ready(queues)

    def _forward(self, key: tuple[int, int], inputs: Sequence[Tensors] | None) -> None:
        s, i = key
        if s == 0:
            if inputs is None:
                raise ValueError("the device holding stage 0 needs the micro-batches as `inputs`")
            x = as_tuple(inputs[i], s)
        else:
            x = self._receive(Kind.ACT, s - 1, key)
            if torch.is_grad_enabled():
                x = tuple(t.requires_grad_(True) if t.is_floating_point() else t for t in x)
        self._capturing = [] if s in self._owners and torch.is_grad_enabled() else None
        hooks = self.saved.hooks() if self.saved is not None else contextlib.nullcontext()
        recompute = torch.is_grad_enabled() and recomputes(self.checkpoint, i, self._key[1])
        with self._span("fwd", i), hooks:
            if recompute:  # keep only the inputs; the backward runs the forward again
                out = as_tuple(checkpoint(self.stages[s], *x, use_reentrant=False), s)
            else:
                out = as_tuple(self.stages[s](*x), s)
        if self._capturing is not None:
            self._captured[key] = self._capturing
        self._capturing = None
        if torch.is_grad_enabled():
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
                captured = self._captured.pop(key, [])
                got = torch.autograd.grad([o for o, _ in pairs], wanted + [t for _, t in captured],
                                          [g for _, g in pairs], retain_graph=True,
                                          allow_unused=True)  # fmt: skip
                x_grads = list(got[: len(wanted)])
                self._w_grads[key] = [(m, t, g) for (m, t), g in zip(captured, got[len(wanted):])
                                      if g is not None]  # fmt: skip
            else:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                x_grads = [t.grad for t in wanted]
        if s > 0:
            it = iter(x_grads)
            back = []
            for t in x:
                if t.is_floating_point():  # unused inputs get a zero gradient
                    g = next(it) if t.requires_grad else None
                    back.append(torch.zeros_like(t) if g is None else g)
            back = tuple(back)
            self._send(Kind.GRAD, s - 1, key, back)

    def _weight_grads(self, key: tuple[int, int]) -> None:
        for module, out, grad in self._w_grads.pop(key, []):
            params = [p for p in module.parameters(recurse=False) if p.requires_grad]
            torch.autograd.backward(out, grad, inputs=params)

    # ---- messages -------------------------------------------------------------------------
    def _send(self, kind: Kind, to_stage: int, key: tuple[int, int], tensors: Tensors) -> None:
        dst = self.device_of(to_stage)
        meta = {"step": self.step_index, "chunk": key[1]}
        if dst == self.comm.rank:  # the next stage is on this device (one device)
            self._local[(kind, to_stage, key[1])] = tensors
            return
        hkey = self._key + (kind, to_stage, key[1], "sent")
        if kind == Kind.ACT and hkey not in self._shapes:
            header = write_header(tensors).to(self._device())
            self._sends.append(self.comm.isend(header, dst, tag=Kind.HEADER, **meta))
            self._shapes[hkey] = [(t.shape, t.dtype) for t in tensors]
        for t in tensors:
            self._sends.append(self.comm.isend(t, dst, tag=kind, **meta))

    def _receive(self, kind: Kind, from_stage: int, key: tuple[int, int],
                 like: Sequence[torch.Tensor] = ()) -> Tensors:  # fmt: skip
        src = self.device_of(from_stage)
        s, i = key
        if src == self.comm.rank:
            return self._local.pop((kind, s, i))
        posted = self._posted.pop((kind, key), None)
        if posted is not None:  # a new tensor on each kept buffer (see below)
            return tuple(h.wait().detach() for h in posted)
        queue = self._queues.get(kind, [])
        if queue and queue[0] == key:  # not posted ahead (shape unknown yet): posted now
            queue.pop(0)
        meta = {"step": self.step_index, "chunk": i}
        dev = self._device()
        if kind == Kind.ACT:
            hkey = self._key + (kind, s, i)
            if hkey not in self._shapes:
                header = torch.empty(HEADER_LEN, dtype=torch.int64, device=dev)
                header = self.comm.recv(header, src, tag=Kind.HEADER, **meta)
                self._shapes[hkey] = read_header(header.cpu())
            specs = self._shapes[hkey]
        else:  # gradients of this stage's floating outputs, shaped like them
            specs = [(t.shape, t.dtype) for t in like]
        handles = self._post(kind, key, src, specs)
        # a new tensor on each kept buffer: its own requires_grad and .grad every step
        return tuple(h.wait().detach() for h in handles)


def _parameter_owners(module: nn.Module, stage: int) -> list[nn.Module]:
    owners, seen = [], {}
    for name, sub in module.named_modules():
        params = list(sub.parameters(recurse=False))
        for p in params:
            if id(p) in seen:
                raise ValueError(
                    f"schedule='zero_bubble' refuses stage {stage}: parameter {name} is shared "
                    f"with {seen[id(p)]} (tied weights), whose weight-gradient step W would count "
                    "one module's path twice; use schedule='1f1b', or put the tied layers apart"
                )
            seen[id(p)] = name or "the stage"
        if params:
            owners.append(sub)
    return owners
