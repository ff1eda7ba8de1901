def balance_by_bytes(layer_bytes: list[int], num_stages: int) -> list[int]:
    """Layers per stage: consecutive groups of ``layer_bytes``, each with at least one layer,
    whose largest sum is as small as possible."""

    def greedy(cap: int) -> list[int]:
        # fill each stage up to cap; a layer larger than cap still gets a stage of its own
        parts, load = [0], 0
        for size in layer_bytes:
            if parts[-1] and load + size > cap:
                parts.append(0)
                load = 0
            parts[-1] += 1
            load += size
        return parts

    # the smallest capacity the greedy fill manages with num_stages stages (binary search:
    # a larger capacity never needs more stages)
    lo, hi = max(layer_bytes), sum(layer_bytes)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(greedy(mid)) <= num_stages:
            hi = mid
        else:
            lo = mid + 1
    parts = greedy(lo)
    while len(parts) < num_stages:  # too few stages: split one, which makes none fuller
        i = max(range(len(parts)), key=parts.__getitem__)
        parts[i : i + 1] = [parts[i] - 1, 1]
    return parts
