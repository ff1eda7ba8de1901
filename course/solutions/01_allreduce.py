import torch
import torch.distributed as dist

from lightning_par.split import even_sizes, offsets


def my_ring_allreduce(t: torch.Tensor) -> torch.Tensor:
    """Sum t in place over all ranks, like dist.all_reduce(t), with a ring of dist.isend /
    dist.irecv: p - 1 reduce-scatter steps, then p - 1 all-gather steps. Return t."""
    p, r = dist.get_world_size(), dist.get_rank()
    if p == 1 or t.numel() == 0:
        return t
    work = t.contiguous().view(-1)  # a copy if t is a non-contiguous view (copied back below)
    sizes = even_sizes(work.numel(), p)
    starts = offsets(sizes)
    part = [work[starts[c] : starts[c] + sizes[c]] for c in range(p)]
    right, left = (r + 1) % p, (r - 1) % p
    incoming = torch.empty(max(sizes), dtype=t.dtype)
    for step in range(2 * (p - 1)):
        reducing = step < p - 1  # reduce-scatter first, then all-gather
        s = step if reducing else step - (p - 1)
        if reducing:
            send_c, recv_c = (r - s) % p, (r - s - 1) % p
        else:
            send_c, recv_c = (r + 1 - s) % p, (r - s) % p
        target = incoming[: sizes[recv_c]] if reducing else part[recv_c]
        # post both before waiting on either: every rank sends and receives in the same step
        handles = [dist.irecv(target, left)] if sizes[recv_c] else []
        handles += [dist.isend(part[send_c], right)] if sizes[send_c] else []
        for h in handles:
            h.wait()
        if reducing:
            part[recv_c].add_(target)
    if work.data_ptr() != t.data_ptr():
        t.copy_(work.view(t.shape))
    return t
