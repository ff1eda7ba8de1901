"""Splitting a length into near-equal consecutive parts: the one helper behind ring chunks,
micro-batches, pipeline stages, sharded servers and tensor slices; and a sequence of costs
into consecutive parts whose largest is as small as it can be (pipeline stages of an
``nn.Sequential``, :mod:`lightning_par.pipeline.partition`, or of any network's units,
:mod:`lightning_par.graphcut.auto`)."""

from __future__ import annotations

from collections.abc import Sequence


def even_sizes(total: int, parts: int) -> list[int]:
    """``parts`` sizes that add up to ``total`` and differ by at most one; the first
    ``total % parts`` get the extra one (so ``total < parts`` leaves some parts empty)."""
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts: need at least one")
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def offsets(sizes: Sequence[int]) -> list[int]:
    """Where each part starts: ``[0, s0, s0 + s1, ...]`` (one per part)."""
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += size
    return starts


def bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` of consecutive parts of the given sizes."""
    return [(start, start + size) for start, size in zip(offsets(sizes), sizes)]


def even_bounds(total: int, parts: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of :func:`even_sizes` parts."""
    return bounds(even_sizes(total, parts))


def balance_by_cost(costs: Sequence[float], num_stages: int) -> list[int]:
    """Cut ``costs`` (one per layer) into ``num_stages`` consecutive non-empty parts so that the
    most expensive part is as cheap as possible (the classic linear-partition dynamic
    programme; exact, O(K·n²) for n layers)."""
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(
            f"cannot split {n} layers into {num_stages} stages: need 1 <= stages <= layers"
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: lowest max-stage cost for the first i layers in k stages; cut[k][i]: last cut.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                # ties go to the later cut, which keeps earlier stages light
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost <= best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    balance, i = [], n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        balance.append(i - j)
        i = j
    return balance[::-1]
