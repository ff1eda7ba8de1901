import torch
import torch.distributed as dist
from torch import nn


class MyZeroOne:
    """ZeRO stage 1 on this rank: the whole model, the optimizer on this rank's slice only.

    The parameters are laid end to end in a flat vector padded to p * S elements, S = ceil(n / p);
    this rank owns [rank * S, (rank + 1) * S). After backward, step() reduce-scatters the
    gradients, steps this rank's slice with the optimizer from make_optimizer([slice]), and
    all-gathers the new weights into the model."""

    def __init__(self, model, make_optimizer, reduce_scatter, all_gather):
        self.params = list(model.parameters())
        self.reduce_scatter, self.all_gather = reduce_scatter, all_gather
        self.world_size, rank = dist.get_world_size(), dist.get_rank()
        n = sum(q.numel() for q in self.params)
        self.size = -(-n // self.world_size)  # S, padding included
        self.lo = rank * self.size
        weights = self._flat([q.detach() for q in self.params])
        # a leaf of its own (not a view of the model): the optimizer's state is S elements
        self.slice = nn.Parameter(weights[self.lo : self.lo + self.size].clone())
        self.optimizer = make_optimizer([self.slice])

    def _flat(self, tensors):
        """``tensors`` end to end in a vector of p * S elements, zeros after the last."""
        flat = torch.zeros(self.world_size * self.size)
        start = 0
        for q, t in zip(self.params, tensors):
            if t is not None:  # a parameter without a gradient contributes zeros
                flat[start : start + q.numel()] = t.reshape(-1)
            start += q.numel()
        return flat

    def step(self):
        grads = self._flat([q.grad for q in self.params])
        mine = self.reduce_scatter(grads)  # chunk rank of the sum over the ranks
        self.slice.grad = mine / self.world_size
        self.optimizer.step()
        weights = torch.zeros(self.world_size * self.size)
        weights[self.lo : self.lo + self.size] = self.slice.detach()
        self.all_gather(weights)  # every rank's new slice, in place
        start = 0
        with torch.no_grad():
            for q in self.params:
                q.copy_(weights[start : start + q.numel()].view_as(q))
                start += q.numel()
