"""Remedies for stale gradients in asynchronous SGD, applied by the server to each push.

An asynchronous update was computed on weights ``w_read`` (the worker's last pull) and is
applied to the server's current weights ``w``, ``tau`` updates later (its staleness). The
server knows ``tau`` and ``w``, and keeps each worker's ``w_read`` (the weights it last
sent that worker), so every remedy lives here, before the user's optimiser step:

* **staleness-aware learning rate** (Zhang, Gupta, Lian & Liu, "Staleness-aware Async-SGD
  for Distributed Deep Learning", IJCAI 2016): an update ``tau`` steps stale is applied at
  ``eta / tau``. Done by scaling the gradient by ``1 / max(1, tau)`` (a fresh or once-stale
  update keeps the full rate): with plain SGD exactly ``eta / tau``; with momentum it scales
  this gradient's share of the velocity, not the velocity the fresh updates built up.
* **delay compensation** (DC-ASGD, Zheng et al., "Asynchronous Stochastic Gradient Descent
  with Delay Compensation", ICML 2017): a first-order Taylor correction of the gradient
  towards the current weights, with ``g ⊙ g`` standing in for the Hessian's diagonal,
  elementwise ``g + lambda * g * g * (w - w_read)``; with ``dc_mean_square=m`` the
  adaptive variant DC-ASGD-a, ``lambda / sqrt(MS)`` with ``MS <- m MS + (1 - m) g * g``;
* **lower momentum** (Mitliagkas, Zhang, Hadjis & Ré, "Asynchrony begets Momentum",
  2016): asynchrony adds implicit momentum (about ``1 - 1/W`` with ``W`` workers), so the
  explicit momentum should be lowered; ``momentum`` caps the optimiser's on the servers
  (a param group with less keeps its own).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Remedies:
    """What the asynchronous server does to each push before the optimiser applies it.

    Args:
        staleness_lr: scale an update ``tau`` steps stale by ``1 / max(1, tau)``.
        dc_lambda: DC-ASGD's ``lambda`` (0: no compensation).
        dc_mean_square: DC-ASGD-a's decay ``m`` of the mean square of the gradient
            (``None``: constant ``lambda``, DC-ASGD-c).
        momentum: the most momentum the servers use (``None``: the optimiser's own).
        strict: an optimiser without a ``momentum`` setting is an error (when the user
            asked for the cap); otherwise it is left as it is.
    """

    staleness_lr: bool = False
    dc_lambda: float = 0.0
    dc_mean_square: float | None = None
    momentum: float | None = None
    strict: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.staleness_lr, bool):
            raise TypeError(f"staleness_lr must be True or False, got {self.staleness_lr!r}")
        if not _number(self.dc_lambda) or self.dc_lambda < 0:
            raise ValueError(f"dc_lambda must be a number >= 0 (0: off), got {self.dc_lambda!r}")
        m = self.dc_mean_square
        if m is not None and (not _number(m) or not 0 <= m < 1):
            raise ValueError(f"dc_mean_square must be in [0, 1) or None, got {m!r}")
        if m is not None and self.dc_lambda == 0:
            raise ValueError("dc_mean_square is DC-ASGD-a's decay: give dc_lambda > 0 too")
        mu = self.momentum
        if mu is not None and (not _number(mu) or not 0 <= mu < 1):
            raise ValueError(f"momentum must be in [0, 1) or None, got {mu!r}")

    @property
    def compensates(self) -> bool:
        """Whether the server must keep each worker's last weights (DC-ASGD)."""
        return self.dc_lambda > 0

    def __str__(self) -> str:
        parts = ["staleness_lr"] if self.staleness_lr else []
        if self.dc_lambda:
            adaptive = f", m={self.dc_mean_square:g}" if self.dc_mean_square is not None else ""
            parts.append(f"dc(lambda={self.dc_lambda:g}{adaptive})")
        if self.momentum is not None:
            parts.append(f"momentum={self.momentum:g}")
        return "+".join(parts) or "none"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def staleness_scale(staleness: int) -> float:
    """Zhang et al. 2016: the factor ``1 / max(1, tau)`` of an update ``tau`` steps stale."""
    return 1.0 / max(1, staleness)


def compensate(
    grad: torch.Tensor, weights: torch.Tensor, read: torch.Tensor, lam: float | torch.Tensor
) -> torch.Tensor:
    """DC-ASGD's gradient at the current weights, elementwise:
    ``grad + lam * grad * grad * (weights - read)`` (a new tensor)."""
    return grad + lam * grad * grad * (weights - read)


def adaptive_lambda(
    grad: torch.Tensor, mean_square: torch.Tensor, lam: float, decay: float, eps: float = 1e-7
) -> torch.Tensor:
    """DC-ASGD-a: update ``mean_square`` in place (``m MS + (1 - m) g * g``) and return
    ``lam / sqrt(MS + eps)``, elementwise."""
    mean_square.mul_(decay).addcmul_(grad, grad, value=1 - decay)
    return lam / (mean_square + eps).sqrt()


def cap_momentum(groups: list[dict[str, Any]], momentum: float, strict: bool = True) -> None:
    """Lower every optimiser param group's momentum to at most ``momentum`` (the servers'
    copy); a group without one is an error if ``strict``, else left alone."""
    for group in groups:
        if "momentum" in group:
            group["momentum"] = min(group["momentum"], momentum)
        elif strict:
            raise ValueError(
                "the momentum remedy needs an optimiser with a 'momentum' setting (SGD, "
                f"RMSprop); this one's param group has {sorted(k for k in group if k != 'params')}"
            )


class StaleUpdate:
    """One server's remedies: the weights each worker last read, DC-ASGD-a's mean squares."""

    def __init__(self, remedies: Remedies, flat: list[torch.Tensor], workers: int) -> None:
        self.remedies = remedies
        self.read: list[dict[int, torch.Tensor]] = [{} for _ in range(workers)]
        self.mean_square = [torch.zeros_like(f) for f in flat]
        self.flat = flat

    def sent(self, worker: int, buckets: list[int]) -> None:
        """The server sent ``worker`` these buckets' current weights: its ``w_read``."""
        if self.remedies.compensates:
            for b in buckets:
                self.read[worker][b] = self.flat[b].clone()

    def gradient(
        self, worker: int, bucket: int, grad: torch.Tensor, staleness: int
    ) -> torch.Tensor:
        """The gradient the optimiser applies for ``worker``'s push of ``bucket``."""
        r = self.remedies
        if r.compensates:
            lam: float | torch.Tensor = r.dc_lambda
            if r.dc_mean_square is not None:
                lam = adaptive_lambda(grad, self.mean_square[bucket], r.dc_lambda, r.dc_mean_square)
            grad = compensate(grad, self.flat[bucket], self.read[worker][bucket], lam)
        if r.staleness_lr:
            grad = grad * staleness_scale(staleness)
        return grad


#: The servers' momentum cap of ``momentum="auto"`` (Mitliagkas et al. 2016; measured best
#: by ``python -m lightning_par.bench async``, ``benchmarks/async.md``).
AUTO_MOMENTUM = 0.5


def choose_remedies(
    staleness: int | None, staleness_lr: bool, dc_lambda: float, dc_mean_square: float | None,
    momentum: float | str | None,
) -> Remedies:  # fmt: skip
    """``async_sgd``'s remedy options as :class:`Remedies`: ``momentum="auto"`` is
    :data:`AUTO_MOMENTUM` (not strict: no cap where the optimiser has no momentum), none at
    ``staleness=0``, where no update is stale and any other remedy is an error."""
    auto = momentum == "auto"
    if auto:
        momentum = None if staleness == 0 else AUTO_MOMENTUM
    remedies = Remedies(staleness_lr, dc_lambda, dc_mean_square, momentum, not auto)  # type: ignore[arg-type]
    if staleness == 0 and remedies != Remedies(strict=not auto):
        raise ValueError(
            f"async_sgd(staleness=0) is the synchronous parameter server: no update is "
            f"stale, so the remedies ({remedies}) do not apply; use staleness >= 1 or None"
        )
    return remedies


def for_workers(remedies: Remedies, num_workers: int) -> Remedies:
    """The remedies the servers run with ``num_workers`` workers: the automatic momentum cap
    is off with one (one process's SGD, no asynchrony to add momentum: Mitliagkas et al.,
    ``1 - 1/W``), so the model's momentum stays."""
    if not remedies.strict and num_workers < 2:
        return dataclasses.replace(remedies, momentum=None)
    return remedies


def check_momentum(remedies: Remedies, optimizers: list[torch.optim.Optimizer]) -> str | None:
    """Refuse an explicit momentum cap for an optimiser that has no momentum (before the
    servers learn the optimiser, so that they do not fail at the first push); for the
    automatic cap, the line that says what it changes (None: nothing)."""
    cap = remedies.momentum
    if cap is None:
        return None
    if remedies.strict:
        for opt in optimizers:
            if any("momentum" not in group for group in opt.param_groups):
                raise ValueError(
                    f"async_sgd(momentum={cap}) sets the servers' momentum, but "
                    f"{type(opt).__name__} has none; use SGD (or RMSprop) or leave "
                    'momentum="auto" (no cap without one) or None'
                )
        return None
    above = sorted({g["momentum"] for o in optimizers for g in o.param_groups
                    if g.get("momentum", 0) > cap})  # fmt: skip
    if not above:
        return None
    return (
        f"async_sgd: the servers step with momentum {cap} instead of the optimiser's "
        f'{", ".join(map(str, above))} (momentum="auto": asynchrony adds momentum of its own, '
        "Mitliagkas et al. 2016); pass momentum=None to keep it"
    )
