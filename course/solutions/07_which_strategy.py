def my_bytes_per_step(strategy, n, p, period=4):
    """Bytes one worker sends per step (float32) to move ``n`` elements among ``p`` workers."""
    if strategy == "ring_allreduce":  # reduce-scatter + all-gather: 2 (p - 1) chunks of n / p
        return 2 * (p - 1) * (n // p) * 4
    if strategy == "parameter_server":  # push the whole gradient; the pull comes back
        return 4 * n
    if strategy == "local_sgd":  # a ring allreduce of the weights, once every `period` steps
        return 2 * (p - 1) * (n // p) * 4 / period
    raise ValueError(f"no formula for {strategy!r}")
