"""The receive side of the pipeline runtime
(:class:`~lightning_par.pipeline.multistage.DeviceStages`): receives posted ahead of the
compute that needs them, into buffers kept from step to step.

At the start of a step list the device knows every message it will receive from another
device, in the order its steps consume them (:meth:`ReceiveAhead._receive_queues`). It posts
each receive as soon as the receive buffer's shape is known (activations: from an earlier
step's header; gradients: once the forward of that micro-batch ran, since the gradient is
shaped like its output), into a buffer kept from step to step. Messages of one kind from one
peer match receives in the order they are posted, so a receive is posted only after every
earlier one of its kind. A receive posted ahead costs nothing to wait for once its message
arrived; one posted only when needed makes gloo's sender wait for it (torch's pipelining
schedules also post a step's receives before its compute).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lightning_par.comm import Communicator, Handle
from lightning_par.pipeline.messages import HEADER_LEN, Kind, Tensors, read_header
from lightning_par.pipeline.schedule import Step

Key = tuple[int, int]  # (stage, micro-batch)


class ReceiveAhead:
    """The receive side of a device: queues, early posting, kept buffers (a mixin)."""

    comm: Communicator
    num_stages: int
    step_index: int
    device_of: Callable[[int], int]
    _key: tuple
    _shapes: dict[tuple, list[tuple[torch.Size, torch.dtype]]]
    _outputs: dict[Key, tuple[torch.Tensor, ...]]
    _buffers: dict[tuple, torch.Tensor]
    _posted: dict[tuple[Kind, Key], list[Handle]]
    _queues: dict[Kind, list[Key]]
    _local: dict[tuple[Kind, int, int], Tensors]

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    def _receive_queues(self, steps: Sequence[Step]) -> dict[Kind, list[Key]]:
        """The (stage, micro-batch) of each message ``steps`` will receive from another
        device, per kind, in the order the steps consume them."""
        queues: dict[Kind, list[Key]] = {Kind.ACT: [], Kind.GRAD: []}
        me, last = self.comm.rank, self.num_stages - 1
        for step in steps:
            s = step.stage
            if step.op == "fwd" and s > 0 and self.device_of(s - 1) != me:
                queues[Kind.ACT].append((s, step.micro_batch))
            elif step.op in ("bwd", "bwd_input") and s < last and self.device_of(s + 1) != me:
                queues[Kind.GRAD].append((s, step.micro_batch))
        return queues

    def _post_ready(self, queues: dict[Kind, list[Key]]) -> None:
        """Post the head of each queue while its shape is known (module docstring)."""
        for kind, queue in queues.items():
            while queue:
                key = queue[0]
                if kind == Kind.ACT:
                    specs = self._shapes.get(self._key + (kind, *key))
                else:
                    out = self._outputs.get(key)
                    specs = None if out is None else [(t.shape, t.dtype) for t in out
                                                      if t.is_floating_point()]  # fmt: skip
                if specs is None:
                    break
                queue.pop(0)
                src = self.device_of(key[0] - 1 if kind == Kind.ACT else key[0] + 1)
                self._posted[(kind, key)] = self._post(kind, key, src, specs)

    def _post(self, kind: Kind, key: Key, src: int,
              specs: Sequence[tuple[torch.Size, torch.dtype]]) -> list[Handle]:  # fmt: skip
        meta = {"step": self.step_index, "chunk": key[1]}
        dev = self.device
        return [self.comm.irecv(self._buffer(kind, key, n, sh, dt, dev), src, tag=kind, **meta)
                for n, (sh, dt) in enumerate(specs)]  # fmt: skip

    def _buffer(self, kind: Kind, key: Key, n: int, shape: torch.Size,
                dtype: torch.dtype, dev: torch.device) -> torch.Tensor:  # fmt: skip
        # One receive buffer per (kind, stage, micro-batch, tensor), kept from step to step: a
        # fresh allocation per message made the C library hand the pages back to the OS and
        # fault them in again every step (up to 1700 page faults per step on the CNN's second
        # stage at M = 8; see benchmarks/pipeline.md). The next step's receive rewrites it only
        # after this step's backward used it (on CUDA, NCCL's stream and the staging copy wait
        # for the compute stream's earlier kernels).
        buf = self._buffers.get((kind, key, n))
        if buf is None or buf.shape != shape or buf.dtype != dtype or buf.device != dev:
            buf = self._buffers[(kind, key, n)] = torch.empty(shape, dtype=dtype, device=dev)
        return buf

    def _receive(self, kind: Kind, from_stage: int, key: Key,
                 like: Sequence[torch.Tensor] = ()) -> Tensors:  # fmt: skip
        """The tensors of ``key``'s message of ``kind`` from ``from_stage``: posted ahead, or
        posted now (after reading the shape header of a first activation)."""
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
        if kind == Kind.ACT:
            hkey = self._key + (kind, s, i)
            if hkey not in self._shapes:
                self._shapes[hkey] = self._receive_header(src, i)
            specs = self._shapes[hkey]
        else:  # gradients of this stage's floating outputs, shaped like them
            specs = [(t.shape, t.dtype) for t in like]
        handles = self._post(kind, key, src, specs)
        # a new tensor on each kept buffer: its own requires_grad and .grad every step
        return tuple(h.wait().detach() for h in handles)

    def _receive_header(self, src: int, chunk: int) -> list[tuple[torch.Size, torch.dtype]]:
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        meta = {"step": self.step_index, "chunk": chunk}
        return read_header(self.comm.recv(header, src, tag=Kind.HEADER, **meta).cpu())
