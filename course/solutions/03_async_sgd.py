import torch
import torch.distributed as dist

from lightning_par.strategies._base import ParStrategy


def staleness_aware_lr(lr, staleness):
    """The learning rate of an update `staleness` updates stale (Zhang et al. 2016):
    lr / staleness, and the full lr for a fresh or once-stale update."""
    return lr / max(1, staleness)


def dc_gradient(grad, weights, read, lam):
    """DC-ASGD's compensated gradient, element by element:
    grad + lam * grad * grad * (weights - read)."""
    return grad + lam * grad * grad * (weights - read)


class MyRingStrategy(ParStrategy):
    """Data parallelism whose gradients are averaged by my ring (01), bucket by bucket while
    backward runs (my MyGradientBuckets, 02), both loaded in section 6."""

    def __init__(self, cap_bytes, **kwargs):
        super().__init__(**kwargs)
        self.cap_bytes = cap_bytes

    def sync_model_states(self):
        with torch.no_grad():  # every rank starts from rank 0's weights and buffers
            for t in [*self.model.parameters(), *self.model.buffers()]:
                dist.broadcast(t.data, src=0)

    def configure_sync(self):
        self.buckets = MyGradientBuckets(self.model, my_ring_allreduce, self.cap_bytes)  # noqa: F821

    def post_backward(self, closure_loss):
        self.buckets.finish()  # the last bucket, before the optimiser steps
