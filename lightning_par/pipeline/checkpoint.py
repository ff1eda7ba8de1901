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

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

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


def run_forward(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, recompute: bool
) -> torch.Tensor:
    """``fn(x)``, storing only ``x`` for the backward pass when ``recompute`` is true."""
    if recompute and torch.is_grad_enabled():
        return checkpoint(fn, x, use_reentrant=False)
    return fn(x)


class SavedActivations:
    """Counts bytes autograd saves for the backward pass (``saved_tensors_hooks``),
    leaving out parameters and counting each storage once.

    Under re-materialisation, ``torch.utils.checkpoint`` saves nothing through these hooks;
    the stage input it keeps must be added separately (:meth:`add`).
    """

    def __init__(self, exclude: list[torch.Tensor] | None = None) -> None:
        self._exclude = {t.data_ptr() for t in exclude or []}
        self._seen: set[int] = set()
        self.nbytes = 0

    def add(self, tensor: torch.Tensor) -> None:
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in self._exclude or ptr in self._seen:
            return
        self._seen.add(ptr)
        self.nbytes += tensor.untyped_storage().nbytes()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.add(tensor)
        return tensor

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
