"""Re-materialisation: store fewer activations, recompute them in the backward pass.

GPipe (Huang et al., 2019, section 2.2) keeps only each stage's input per micro-batch and
recomputes the stage's forward during the backward pass, cutting activation memory from
O(N·L) to O(N + L/K · N/M). The modes follow torchgpipe (Kim et al., 2020):

* ``"never"``: store every activation (fastest, most memory);
* ``"except_last"``: recompute every micro-batch but the last, whose backward follows its
  forward immediately in GPipe, so recomputing it would buy nothing (torchgpipe's default);
* ``"always"``: recompute every micro-batch.

Recomputation uses ``torch.utils.checkpoint`` in its non-reentrant form, which also replays
the random state, so dropout masks match between the two forwards.
"""

from __future__ import annotations

import time

import torch

CHECKPOINT_MODES = ("never", "except_last", "always")


def check_mode(mode: str) -> str:
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"unknown checkpoint mode {mode!r}: choose one of {CHECKPOINT_MODES}")
    return mode


def recomputes(mode: str, micro_batch: int, chunks: int) -> bool:
    """Whether ``micro_batch`` (of ``chunks``) is re-materialised under ``mode``."""
    check_mode(mode)
    if mode == "always":
        return True
    return mode == "except_last" and micro_batch < chunks - 1


class SavedActivations:
    """Counts bytes autograd saves for the backward pass (``saved_tensors_hooks``),
    leaving out parameters and counting each storage once.

    * :attr:`nbytes`: every storage saved during the step, whether or not it is still held;
    * :attr:`live`: bytes held right now, :attr:`peak`: the most held at any moment, and
      :attr:`history`: ``(time.perf_counter(), live)`` after every change. A saved tensor
      stops counting when autograd drops it (after its backward, or with its graph), which is
      when its memory can be freed; so GPipe's peak holds all M micro-batches, 1F1B's fewer.

    Under re-materialisation, ``torch.utils.checkpoint`` saves nothing through these hooks;
    the stage input it keeps must be added separately (:meth:`add`, or :meth:`hold` to count
    it as live while a graph needs it). The activations recomputed during a backward are
    not seen by these hooks either (they live only inside that backward).
    """

    def __init__(self, exclude: list[torch.Tensor] | None = None) -> None:
        self._exclude = {t.data_ptr() for t in exclude or []}
        self._seen: set[int] = set()
        self._refs: dict[int, int] = {}  # storage pointer -> saved tensors holding it
        self._sizes: dict[int, int] = {}
        self.nbytes = self.live = self.peak = 0
        self.history: list[tuple[float, int]] = []

    def add(self, tensor: torch.Tensor) -> None:
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in self._exclude or ptr in self._seen:
            return
        self._seen.add(ptr)
        self.nbytes += tensor.untyped_storage().nbytes()

    def _acquire(self, tensor: torch.Tensor) -> _Held:
        ptr = tensor.untyped_storage().data_ptr()
        self.add(tensor)
        self._refs[ptr] = self._refs.get(ptr, 0) + 1
        if self._refs[ptr] == 1:
            self._sizes[ptr] = tensor.untyped_storage().nbytes()
            self._change(self._sizes[ptr])
        return _Held(tensor, self, ptr)

    def _release(self, ptr: int) -> None:
        self._refs[ptr] -= 1
        if self._refs[ptr] == 0:
            del self._refs[ptr]
            self._change(-self._sizes.pop(ptr))

    def _change(self, delta: int) -> None:
        self.live += delta
        self.peak = max(self.peak, self.live)
        self.history.append((time.perf_counter(), self.live))

    def hold(self, tensor: torch.Tensor, output: torch.Tensor) -> None:
        """Count ``tensor`` as saved for as long as ``output``'s autograd graph exists (the
        input that a re-materialised stage keeps to recompute ``output``)."""
        if output.grad_fn is None or tensor.untyped_storage().data_ptr() in self._exclude:
            self.add(tensor)
            return
        output.grad_fn.metadata.setdefault("saved_activations", []).append(self._acquire(tensor))

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _Held:
        if tensor.untyped_storage().data_ptr() in self._exclude:
            return tensor
        return self._acquire(tensor)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)


class _Held:
    """A saved tensor as autograd keeps it; releases its count when autograd drops it."""

    __slots__ = ("_owner", "_ptr", "tensor")

    def __init__(self, tensor: torch.Tensor, owner: SavedActivations, ptr: int) -> None:
        self.tensor, self._owner, self._ptr = tensor, owner, ptr

    def __del__(self) -> None:
        self._owner._release(self._ptr)


def _unpack(held: torch.Tensor | _Held) -> torch.Tensor:
    return held.tensor if isinstance(held, _Held) else held
