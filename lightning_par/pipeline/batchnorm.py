"""BatchNorm whose running statistics cover the whole mini-batch, not each micro-batch.

Under GPipe a batch of ``N`` samples runs as ``M`` micro-batches, so an ``nn.BatchNorm``
normalises each micro-batch with its own statistics and updates its running statistics ``M``
times per step, on ``N/M`` samples each (and once more for every micro-batch re-materialised
in the backward pass). torchgpipe's deferred batch normalisation (Kim et al., 2020,
"torchgpipe: On-the-fly Pipeline Parallelism for Training Giant Models", section 3.4) keeps
normalising per micro-batch but *defers* the running-statistics update to the end of the
mini-batch: each micro-batch adds its inputs' sum and sum of squares, and :meth:`commit`
updates the running mean and (unbiased) variance once, from all ``N`` samples, as one
process's BatchNorm does on the whole batch. Re-materialising forwards (they run inside a
backward pass) add nothing.

:func:`defer_batch_norm` swaps a network's BatchNorm layers for
:class:`DeferredBatchNorm` (same parameters, buffers and state-dict keys);
:func:`commit_batch_norm` ends a mini-batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def _in_backward() -> bool:
    """True while autograd runs a backward pass (a re-materialising forward)."""
    return torch._C._current_graph_task_id() != -1


class DeferredBatchNorm(_BatchNorm):
    """A BatchNorm (any dimension) that updates its running statistics once per mini-batch:
    call :meth:`commit` after the mini-batch's micro-batches."""

    def __init__(self, num_features: int, **kwargs) -> None:
        super().__init__(num_features, **kwargs)
        for name in ("_sum", "_sum_squares"):
            self.register_buffer(name, torch.zeros(num_features), persistent=False)
        self._count = 0

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (batch, channels, ...), got {x.dim()}D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.track_running_stats):
            return super().forward(x)
        self._check_input_dim(x)
        if not _in_backward():
            dims = [0, *range(2, x.dim())]
            with torch.no_grad():
                values = x.detach().to(self._sum.dtype)
                self._sum += values.sum(dims)
                self._sum_squares += (values * values).sum(dims)
                self._count += x.numel() // x.shape[1]
        # normalise with this micro-batch's statistics; no running update here
        return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @torch.no_grad()
    def commit(self) -> None:
        """Fold the mini-batch's statistics into the running ones (as one BatchNorm step
        on the whole mini-batch) and start a new mini-batch."""
        n = self._count
        if n == 0:
            return
        mean = self._sum / n
        var = (self._sum_squares / n - mean * mean).clamp_(min=0)
        if n > 1:
            var *= n / (n - 1)  # BatchNorm keeps the unbiased variance
        self.num_batches_tracked += 1
        m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        self.running_mean.mul_(1 - m).add_(mean.to(self.running_mean.dtype), alpha=m)
        self.running_var.mul_(1 - m).add_(var.to(self.running_var.dtype), alpha=m)
        self._sum.zero_()
        self._sum_squares.zero_()
        self._count = 0

    @classmethod
    def from_batch_norm(cls, bn: _BatchNorm) -> DeferredBatchNorm:
        new = cls(bn.num_features, eps=bn.eps, momentum=bn.momentum, affine=bn.affine,
                  track_running_stats=bn.track_running_stats)  # fmt: skip
        new.load_state_dict(bn.state_dict())
        return new.to(next(iter(bn.state_dict().values()), torch.zeros(())).device)


def defer_batch_norm(module: nn.Module) -> int:
    """Replace every BatchNorm layer under ``module`` (not SyncBatchNorm) by a
    :class:`DeferredBatchNorm` in place; returns how many."""
    count = 0
    for name, child in module.named_children():
        if isinstance(child, _BatchNorm) and not isinstance(
            child, (DeferredBatchNorm, nn.SyncBatchNorm)
        ):
            setattr(module, name, DeferredBatchNorm.from_batch_norm(child))
            count += 1
        else:
            count += defer_batch_norm(child)
    return count


def commit_batch_norm(module: nn.Module) -> None:
    """End the mini-batch of every :class:`DeferredBatchNorm` under ``module``."""
    for sub in module.modules():
        if isinstance(sub, DeferredBatchNorm):
            sub.commit()
