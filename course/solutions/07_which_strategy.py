def my_local_sgd_step_s(prof, p, topo, speed):
    """Predicted seconds of one local_sgd step on p GPUs (weak scaling: each keeps its batch)."""
    compute = prof.compute_s / speed  # each GPU keeps its batch: the measured compute, faster
    link = topo.slowest(p)  # the ring's slowest hop sets the pace of every one of its steps
    chunk = prof.grad_bytes / p  # reduce-scatter, then all-gather: p - 1 chunks of 1/p each
    ring = 2 * (p - 1) * (link.alpha + link.beta * chunk)
    return compute + ring / prof.options["period"]  # nothing overlaps it; once per period
