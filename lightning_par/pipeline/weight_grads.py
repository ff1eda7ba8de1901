"""The B/W split of a stage's backward, for the zero-bubble schedules.

Qi et al., 2023 (arXiv:2401.10241, section 2) split a stage's backward into B, the input
gradient (which the previous stage waits for), and W, the weight gradients (which nobody
waits for, so the schedule fills bubbles with them).

B is ``torch.autograd.grad(outputs, inputs=stage inputs + the outputs of each module that
owns parameters, retain_graph=True)``: the stage input's gradient (sent at once) and, on the
way, the gradient w.r.t. each parameter-owning module's output, kept for W. W is then, per
such module, ``torch.autograd.backward(module output, its gradient, inputs=its own
parameters)``, which runs only that module's weight-gradient kernels (e.g. ``dW = dY^T X`` of
a Linear), not the input-gradient chain again. (Computing normalisation layers' weight
gradients in B instead saves about 10 % of the split's CPU on the CIFAR CNN, but their saved
tensors then stay until the step ends, doubling the peak activations: see
benchmarks/pipeline.md.) Both halves need the forward's saved activations, so
re-materialisation would recompute the forward for B and again for W: the runtime refuses
checkpointing with the split, and a parameter tied between two modules of one stage (whose
W would count the other module's path twice) is refused here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from lightning_par.pipeline.messages import as_tuple

Key = tuple[int, int]  # (stage, micro-batch)


class WeightGrads:
    """The parameter-owning modules of a device's stages, their outputs captured per
    (stage, micro-batch) in the forward, and the W step run from what B left.

    Args:
        stages: ``{stage index: module}`` of one device.
    """

    def __init__(self, stages: dict[int, nn.Module]) -> None:
        self._owners = {s: parameter_owners(module, s) for s, module in stages.items()}
        for owners in self._owners.values():
            for owner in owners:
                owner.register_forward_hook(self._record)
        self._recording: list | None = None
        self.reset()

    def reset(self) -> None:
        """Drop a step's captured outputs and pending weight gradients."""
        self._captured: dict[Key, list[tuple[nn.Module, torch.Tensor]]] = {}
        self._pending: dict[Key, list[tuple[nn.Module, torch.Tensor, torch.Tensor]]] = {}

    def _record(self, module: nn.Module, args, output) -> None:
        if self._recording is not None:
            for t in as_tuple(output, -1):
                if t.requires_grad:
                    self._recording.append((module, t))

    @contextlib.contextmanager
    def capture(self, key: Key) -> Iterator[None]:
        """Around the forward of ``key``: keep each owner's output for B and W."""
        if key[0] not in self._owners or not torch.is_grad_enabled():
            yield
            return
        self._recording = []
        try:
            yield
            self._captured[key] = self._recording
        finally:
            self._recording = None

    def input_grads(self, key: Key, outputs: Sequence[torch.Tensor],
                    grads: Sequence[torch.Tensor],
                    inputs: list[torch.Tensor]) -> list[torch.Tensor | None]:  # fmt: skip
        """B: the gradients of ``inputs``; the owners' output gradients are kept for W."""
        captured = self._captured.pop(key, [])
        got = torch.autograd.grad(list(outputs), inputs + [t for _, t in captured], list(grads),
                                  retain_graph=True, allow_unused=True)  # fmt: skip
        self._pending[key] = [(m, t, g) for (m, t), g in zip(captured, got[len(inputs):])
                              if g is not None]  # fmt: skip
        return list(got[: len(inputs)])

    def run(self, key: Key) -> None:
        """W: each owner's weight gradients from the output gradient B kept."""
        for module, out, grad in self._pending.pop(key, []):
            params = [p for p in module.parameters(recurse=False) if p.requires_grad]
            torch.autograd.backward(out, grad, inputs=params)


def parameter_owners(module: nn.Module, stage: int) -> list[nn.Module]:
    """The submodules of ``module`` holding parameters of their own; tied ones refused."""
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
