import torch
import torch.distributed as dist


def my_server_link_bytes(numels, element_size, workers, servers, split_bytes):
    """Bytes per step on each server's link: every worker pushes the gradient of the
    parameters that server holds and pulls their new values, 2 * workers * held bytes."""
    held = [0] * servers
    small = []
    for i, n in enumerate(numels):
        if n * element_size > split_bytes and servers > 1 and n >= servers:
            base, extra = divmod(n, servers)  # near-equal slices, one per server
            for s in range(servers):
                held[s] += (base + (1 if s < extra else 0)) * element_size
        else:
            small.append(i)
    for i in sorted(small, key=lambda j: (-numels[j], j)):  # largest first
        s = min(range(servers), key=lambda k: (held[k], k))  # to the least loaded
        held[s] += numels[i] * element_size
    return [2 * workers * b for b in held]


class MyGradientBuckets:
    """Average a model's gradients over all ranks during backward, bucket by bucket.

    Each parameter's gradient joins the open bucket as soon as backward has produced it (a
    post-accumulate-grad hook); once the bucket holds at least ``cap_bytes`` it is packed into
    one flat tensor, summed over the ranks by ``allreduce`` (in place, like
    ``dist.all_reduce``), divided by the number of ranks and written back into the
    gradients. :meth:`finish`, called after backward, does the same for the last bucket."""

    def __init__(self, model, allreduce, cap_bytes):
        self.allreduce, self.cap_bytes = allreduce, cap_bytes
        self.bucket, self.bucket_bytes = [], 0
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, p):
        self.bucket.append(p)
        self.bucket_bytes += p.grad.numel() * p.grad.element_size()
        if self.bucket_bytes >= self.cap_bytes:
            self._reduce()

    def _reduce(self):
        if not self.bucket:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in self.bucket])
        self.allreduce(flat)
        flat /= dist.get_world_size()
        start = 0
        for p in self.bucket:
            n = p.grad.numel()
            p.grad.copy_(flat[start : start + n].view_as(p.grad))
            start += n
        self.bucket, self.bucket_bytes = [], 0

    def finish(self):
        """After backward: reduce the bucket that did not fill up."""
        self._reduce()
