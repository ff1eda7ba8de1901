"""Splitting a length into near-equal consecutive parts: the one helper behind ring chunks,
micro-batches, pipeline stages, sharded servers and tensor slices."""

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
