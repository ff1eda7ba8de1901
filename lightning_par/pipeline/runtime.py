"""One pipeline stage in one process: runs its step list, moving activations forward and
gradients backward through :class:`lightning_par.comm.Communicator`.

Stage ``s`` is group rank ``s``. Per micro-batch ``i``:

* ``fwd``: take micro-batch ``i`` (stage 0) or receive the activation from stage ``s-1``,
  run the stage (re-materialised or not, see :mod:`.checkpoint`), send the output to stage
  ``s+1`` (the last stage keeps it for the loss);
* ``bwd``: take the gradient of the loss w.r.t. the output (last stage: from ``output_grad``;
  others: received from ``s+1``), back-propagate through the stage (accumulating parameter
  gradients over micro-batches, as GPipe does), send the input's gradient to ``s-1``.

Receives are posted as early as their order allows (the notes measured blocking receives
as a main cost of a hand-written pipeline): activation receives for the whole step once
their shapes are known, gradient receives as soon as the matching forward ran. Shapes
travel in a small header the first time a (batch shape, micro-batch) pair is seen; both
ends cache them, since every stage sees the same batches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from lightning_par.comm import Communicator, Event, Handle
from lightning_par.pipeline.checkpoint import SavedActivations, check_mode, recomputes, run_forward
from lightning_par.pipeline.microbatch import micro_batch_sizes
from lightning_par.pipeline.schedule import Step

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.uint8, torch.bool]  # fmt: skip
_MAX_DIMS = 8
OutputGrad = Callable[[int, torch.Tensor], torch.Tensor]


class PipelineStage:
    """Runs one stage's share of a pipeline schedule.

    Args:
        module: this stage's layers (any ``nn.Module`` mapping one tensor to one tensor).
        comm: communicator whose group has one rank per stage (stage = group rank).
        checkpoint: re-materialisation mode, ``"never"``, ``"except_last"`` or ``"always"``.
        device: where received tensors are allocated (default: the module's device).
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator,
        *,
        checkpoint: str = "except_last",
        device: torch.device | None = None,
    ) -> None:
        self.module, self.comm = module, comm
        self.stage, self.num_stages = comm.rank, comm.world_size
        self.checkpoint = check_mode(checkpoint)
        self._device = device
        self.is_first, self.is_last = self.stage == 0, self.stage == self.num_stages - 1
        self.step_index, self._step_start = 0, 0.0
        self.saved: SavedActivations | None = None  # set by measure_memory()
        self._known_shapes: dict[tuple, tuple[torch.Size, torch.dtype]] = {}
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}  # receive buffers, see _buffer
        #: Called just before the step's last backward micro-batch, after which each parameter
        #: gradient is complete (hybrid parallelism starts its data-parallel buckets then).
        self.before_last_backward: Callable[[], None] | None = None
        self._reset()

    @property
    def device(self) -> torch.device:
        """Where received tensors go: the given device, else the stage's parameters'."""
        if self._device is not None:
            return self._device
        param = next(self.module.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    # ---- per-step state -------------------------------------------------------------
    def _reset(self) -> None:
        self._inputs: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._results: dict[int, torch.Tensor] = {}
        self._act_recvs: dict[int, Handle] = {}
        self._grad_recvs: dict[int, Handle] = {}
        self._sends: list[Handle] = []
        self._forwarded: set[int] = set()
        self._backwards = 0

    def begin(self, batch_shape: Sequence[int], chunks: int) -> list[int]:
        """Start a training or inference step on a batch of ``batch_shape`` (known to every
        stage) split into ``chunks`` micro-batches; returns the micro-batch sizes."""
        self._reset()
        self.sizes = micro_batch_sizes(int(batch_shape[0]), chunks)
        self.chunks = chunks
        self._key = (tuple(batch_shape), chunks)
        self._step_start = self.comm.trace.now() if self.comm.trace is not None else 0.0
        if self.saved is not None:
            self.saved = SavedActivations(exclude=list(self.module.parameters()))
        return self.sizes

    def measure_memory(self) -> None:
        """Count activation bytes saved for backward in later steps (see :attr:`saved`)."""
        self.saved = SavedActivations(exclude=list(self.module.parameters()))

    def finish(self) -> None:
        """Wait for this step's sends and drop its activations."""
        for handle in self._sends:
            handle.wait()
        trace = self.comm.trace
        if trace is not None:  # one "step" event per step (micro_batch holds the step index)
            event = Event(self.stage, "step", self._step_start, trace.now(), self.step_index)
            trace.events.append(event)
        self._reset()
        self.step_index += 1

    @property
    def outputs(self) -> list[torch.Tensor]:
        """Last stage: the micro-batch outputs of this step, in order (with autograd graph)."""
        return [self._outputs[i] for i in sorted(self._outputs)]

    def joined_output(self) -> torch.Tensor:
        """Last stage: this step's micro-batch outputs joined into one batch (detached); kept
        after the backward steps, unlike :attr:`outputs`."""
        return torch.cat([self._results[i] for i in sorted(self._results)])

    # ---- running steps --------------------------------------------------------------
    def run(
        self,
        steps: Sequence[Step],
        inputs: Sequence[torch.Tensor] | None = None,
        output_grad: OutputGrad | None = None,
    ) -> None:
        """Execute ``steps`` (all or a contiguous part of this stage's schedule).

        ``inputs``: the micro-batches (needed on stage 0). ``output_grad(i, output_i)``: on
        the last stage, the gradient of the loss w.r.t. micro-batch ``i``'s output.
        """
        fwd = [s.micro_batch for s in steps if s.op == "fwd"]
        bwd = [s.micro_batch for s in steps if s.op == "bwd"]
        if not self.is_first and fwd and all(self._key + (i,) in self._known_shapes for i in fwd):
            for i in fwd:  # shapes known from an earlier step: post every receive now
                self._post_act_recv(i)
        pending_grads = list(bwd)
        self._post_grad_recvs(pending_grads)
        for step in steps:
            if step.op == "fwd":
                self._forward(step.micro_batch, inputs)
            else:
                self._backward(step.micro_batch, output_grad)
            self._post_grad_recvs(pending_grads)

    def _post_grad_recvs(self, pending: list[int]) -> None:
        # in this stage's backward order (the order the next stage sends them), each as soon
        # as its forward ran
        while not self.is_last and pending and pending[0] in self._forwarded:
            i = pending.pop(0)
            out = self._outputs[i]
            buf = self._buffer("grad", i, out.shape, out.dtype)
            self._grad_recvs[i] = self.comm.irecv(buf, self.stage + 1, **self._meta(i, "grad"))

    def _buffer(self, kind: str, i: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        # One receive buffer per (kind, micro-batch), kept from step to step: a fresh
        # allocation per message made the C library hand the pages back to the OS and fault
        # them in again every step (up to 1700 page faults per step on the CNN's second
        # stage at M = 8; see benchmarks/pipeline.md). A buffer is only rewritten by the
        # next step's receive, after this step's backward has released it (on CUDA, NCCL's
        # stream and the staging copy wait for the compute stream's earlier kernels).
        buf = self._buffers.get((kind, i))
        if buf is None or buf.shape != shape or buf.dtype != dtype or buf.device != self.device:
            buf = self._buffers[(kind, i)] = torch.empty(shape, dtype=dtype, device=self.device)
        return buf

    def _meta(self, i: int, tag: str) -> dict:
        return {"step": self.step_index, "chunk": i, "tag": tag}

    def _span(self, name: str, i: int):
        trace = self.comm.trace
        return trace.span(name, micro_batch=i) if trace is not None else contextlib.nullcontext()

    def _post_act_recv(self, i: int) -> None:
        shape, dtype = self._known_shapes[self._key + (i,)]
        buf = self._buffer("act", i, shape, dtype)
        self._act_recvs[i] = self.comm.irecv(buf, self.stage - 1, **self._meta(i, "act"))

    def _forward(self, i: int, inputs: Sequence[torch.Tensor] | None) -> None:
        if self.is_first:
            if inputs is None:
                raise ValueError("stage 0 needs the micro-batches as `inputs`")
            x = inputs[i]
        else:
            if i not in self._act_recvs:
                self._recv_header(i, self.stage - 1)
                self._post_act_recv(i)
            # a new tensor on the kept buffer: its own requires_grad and .grad every step
            x = self._act_recvs.pop(i).wait().detach()
        grad = torch.is_grad_enabled()
        if grad and x.is_floating_point() and not self.is_first:
            x.requires_grad_(True)
        recompute = grad and recomputes(self.checkpoint, i, self.chunks)
        with self._span("fwd", i):
            hooks = self.saved.hooks() if self.saved is not None and grad else None
            with hooks or contextlib.nullcontext():
                out = run_forward(self.module, x, recompute)
            if not isinstance(out, torch.Tensor):
                raise TypeError(
                    f"stage {self.stage} returned {type(out).__name__}; a pipeline stage must "
                    "return one tensor (wrap layers that return tuples, e.g. LSTM)"
                )
        if recompute and self.saved is not None:
            self.saved.hold(x, out)  # checkpoint keeps the stage input to recompute from
        self._forwarded.add(i)
        if grad:
            self._inputs[i] = x
        if self.is_last:
            if not self.is_first and _shares_storage(out, x):
                out = out.clone()  # a view of a kept receive buffer: the next step rewrites it
            self._outputs[i] = out
            self._results[i] = out.detach()
        else:
            if grad:
                self._outputs[i] = out
            self._send_header(i, out, self.stage + 1)
            self._sends.append(
                self.comm.isend(out.detach(), self.stage + 1, **self._meta(i, "act"))
            )

    def _backward(self, i: int, output_grad: OutputGrad | None) -> None:
        self._backwards += 1
        if self._backwards == self.chunks and self.before_last_backward is not None:
            self.before_last_backward()
        out = self._outputs.pop(i)
        if self.is_last:
            if output_grad is None:
                raise ValueError("the last stage needs `output_grad` to run backward steps")
            grad = output_grad(i, out)
        else:
            grad = self._grad_recvs.pop(i).wait()
        x = self._inputs.pop(i)
        with self._span("bwd", i):
            if out.requires_grad:
                torch.autograd.backward(out, grad)
        if not self.is_first:
            g = x.grad if x.grad is not None else torch.zeros_like(x)
            self._sends.append(self.comm.isend(g, self.stage - 1, **self._meta(i, "grad")))

    # ---- shape headers ----------------------------------------------------------------
    def _send_header(self, i: int, tensor: torch.Tensor, dst: int) -> None:
        key = self._key + (i, "sent")
        if key in self._known_shapes:
            return
        if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
            raise TypeError(f"cannot send a {tensor.dim()}-d {tensor.dtype} tensor between stages")
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
        header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        self._sends.append(self.comm.isend(header.to(self.device), dst, **self._meta(i, "header")))
        self._known_shapes[key] = (tensor.shape, tensor.dtype)

    def _recv_header(self, i: int, src: int) -> None:
        header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=self.device)
        header = self.comm.recv(header, src, **self._meta(i, "header")).cpu()
        ndim, dtype = int(header[0]), _DTYPES[int(header[1])]
        self._known_shapes[self._key + (i,)] = (torch.Size(header[2 : 2 + ndim].tolist()), dtype)

    # ---- sharing the full output ----------------------------------------------------------
    def share_output(self, output: torch.Tensor | None) -> torch.Tensor:
        """The last stage sends the joined output to every other stage (so each runs the
        user's loss and metrics on the real values); returns it on every stage."""
        if self.is_last:
            assert output is not None
            out = output.detach()
            handles = []
            for dst in range(self.num_stages - 1):
                self._send_header(-1 - dst, out, dst)
                handles.append(self.comm.isend(out, dst, **self._meta(-1, "output")))
            self._sends.extend(handles)
            return out
        src = self.num_stages - 1
        if self._key + (-1 - self.stage,) not in self._known_shapes:
            self._recv_header(-1 - self.stage, src)
        shape, dtype = self._known_shapes[self._key + (-1 - self.stage,)]
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        return self.comm.recv(buf, src, **self._meta(-1, "output"))


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` lives in ``b``'s memory (a stage made only of views, e.g. ``Flatten``)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
