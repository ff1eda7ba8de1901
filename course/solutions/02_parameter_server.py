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
