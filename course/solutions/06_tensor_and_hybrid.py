import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F


class AllReduceGrad(torch.autograd.Function):
    """Megatron's f: identity forward, allreduce of the input's gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)  # each rank's input gradient is a partial sum
        return grad, None


class GatherColumns(torch.autograd.Function):
    """All-gather the output slices forward; backward, each rank keeps its own slice."""

    @staticmethod
    def forward(ctx, y, rank, world):
        ctx.rank, ctx.width = rank, y.shape[1]
        parts = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(parts, y.contiguous())
        return torch.cat(parts, 1)

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width], None, None


class MyColumnLinear(nn.Module):
    def __init__(self, linear, rank, world):
        super().__init__()
        rows = torch.arange(linear.out_features).chunk(world)[rank]
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        self.bias = nn.Parameter(linear.bias.detach()[rows].clone())
        self.rank, self.world = rank, world

    def forward(self, x):
        y = F.linear(AllReduceGrad.apply(x, None), self.weight, self.bias)
        return GatherColumns.apply(y, self.rank, self.world)


class SumPartials(torch.autograd.Function):
    """Megatron's g: allreduce of the partial outputs forward, identity backward."""

    @staticmethod
    def forward(ctx, partial, group):
        total = partial.clone()
        dist.all_reduce(total, group=group)  # each rank computed x_k W_k^T: the sum is the output
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None  # every rank's partial output entered the sum with weight 1


class MyMegatronMLP(nn.Module):
    def __init__(self, fc1, fc2, rank, world, group=None):
        super().__init__()
        hidden = torch.arange(fc1.out_features).chunk(world)[rank]
        self.w1 = nn.Parameter(fc1.weight.detach()[hidden].clone())  # fc1's output rows
        self.b1 = nn.Parameter(fc1.bias.detach()[hidden].clone())
        self.w2 = nn.Parameter(fc2.weight.detach()[:, hidden].clone())  # fc2's input columns
        self.b2 = nn.Parameter(fc2.bias.detach().clone())  # whole: added once, after the sum
        self.group = group

    def forward(self, x):
        h = F.gelu(F.linear(AllReduceGrad.apply(x, self.group), self.w1, self.b1))  # a slice
        return SumPartials.apply(F.linear(h, self.w2), self.group) + self.b2


def hybrid_train(fc1, fc2, x, y, lr, steps):
    rank = dist.get_rank()
    grid = torch.arange(4).reshape(2, 2)  # rank 2d + t: replica d, tensor shard t
    # every rank creates every group, in the same order (new_group is a collective)
    tp_groups = [dist.new_group(row.tolist()) for row in grid]  # rows: one replica's shards
    dp_groups = [dist.new_group(col.tolist()) for col in grid.T]  # columns: the same shard
    d, t = divmod(rank, 2)
    block = MyMegatronMLP(fc1, fc2, t, 2, group=tp_groups[d])
    xs, ys = x.chunk(2)[d], y.chunk(2)[d]  # replica d's half of the batch
    for _ in range(steps):
        block.zero_grad()
        F.mse_loss(block(xs), ys).backward()
        for p in block.parameters():  # the mean over the replicas: the whole batch's gradient
            dist.all_reduce(p.grad, group=dp_groups[t])
            p.grad /= 2
        with torch.no_grad():
            for p in block.parameters():
                p -= lr * p.grad
    return block
