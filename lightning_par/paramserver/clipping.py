"""Gradient clipping where no process holds the whole averaged gradient.

Lightning clips after backward and before the optimiser step
(``Trainer(gradient_clip_val=c, gradient_clip_algorithm=...)``), with torch's
``clip_grad_norm_`` or ``clip_grad_value_``. On the parameter server the averaged gradient
exists only as shards, one per server, so:

* **by value** (elementwise ``clamp(-c, c)``) each server clamps its own shard: the same
  numbers as one process;
* **by norm** each server computes the squared norm of its shard of the averaged
  gradient, sends it to every other server (``NORM``,
  :func:`~lightning_par.paramserver.messages.exchange_squared_norms`) and sums all of them in server
  order, so every server scales its shard by the same factor ``min(1, c / (‖g‖ + 1e-6))``,
  torch's (Pascanu et al., "On the difficulty of training recurrent neural networks",
  ICML 2013, clip the whole gradient's norm).

Asynchronous SGD applies each worker's gradient on its own, so a worker that holds its
whole gradient clips it before pushing (:func:`clip_flat`), as one process on that batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: torch's ``clip_grad_norm_`` adds this to the norm before dividing.
EPS = 1e-6


@dataclass(frozen=True)
class GradClip:
    """``Trainer(gradient_clip_val=value, gradient_clip_algorithm=algorithm)``."""

    value: float
    algorithm: str = "norm"  # "norm" or "value"

    def __post_init__(self) -> None:
        if self.algorithm not in ("norm", "value"):
            raise ValueError(
                f"gradient_clip_algorithm must be 'norm' or 'value', got {self.algorithm!r}"
            )
        if not self.value > 0:
            raise ValueError(f"gradient_clip_val must be > 0, got {self.value}")


def from_trainer(value: float | None, algorithm: object | None) -> GradClip | None:
    """The clipping a Trainer asks for (``None``: none); ``algorithm`` may be Lightning's
    ``GradClipAlgorithmType`` (a string enum) or ``None`` (Lightning's default: norm)."""
    if not value:
        return None
    name = getattr(algorithm, "value", algorithm) or "norm"
    return GradClip(float(value), str(name))


def squared_norm(grads: Sequence[torch.Tensor]) -> float:
    """The sum of squares of ``grads`` (in float64, so the servers' sum of shards loses
    nothing against one process's float32 norm)."""
    return float(sum(float(g.double().square().sum()) for g in grads))


def norm_factor(total_squared: float, max_norm: float) -> float:
    """torch's ``clip_grad_norm_`` factor from the whole gradient's squared norm."""
    return min(1.0, max_norm / (total_squared**0.5 + EPS))


def clip_value(grad: torch.Tensor, clip: GradClip) -> None:
    """Clamp ``grad`` in place to ``[-c, c]`` (torch's ``clip_grad_value_``)."""
    grad.clamp_(-clip.value, clip.value)


def clip_flat(grads: Sequence[torch.Tensor], clip: GradClip) -> float:
    """Clip a whole gradient (``grads``: every parameter's) in place, as one process would;
    returns its norm before clipping."""
    total = squared_norm(grads)
    if clip.algorithm == "value":
        for g in grads:
            clip_value(g, clip)
    else:
        factor = norm_factor(total, clip.value)
        if factor < 1.0:
            for g in grads:
                g.mul_(factor)
    return total**0.5
