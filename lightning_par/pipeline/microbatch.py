"""Splitting a batch into micro-batches and joining their outputs (GPipe, section 2.2).

A batch of B samples becomes M micro-batches of ``B // M`` or ``B // M + 1`` samples (the
first ``B % M`` get one more), so every micro-batch is non-empty and at most one sample
apart; ``torch.chunk`` would instead return fewer than M pieces for some B (9 in 4 gives 3).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_par.split import even_sizes


def micro_batch_sizes(batch_size: int, chunks: int) -> list[int]:
    """Sizes of the ``chunks`` micro-batches of a batch of ``batch_size`` samples."""
    if chunks < 1:
        raise ValueError(f"chunks (number of micro-batches) must be >= 1, got {chunks}")
    if chunks > batch_size:
        raise ValueError(
            f"cannot split a batch of {batch_size} samples into {chunks} micro-batches: "
            f"use chunks <= {batch_size} or a larger batch size"
        )
    return even_sizes(batch_size, chunks)


def scatter(batch: torch.Tensor, chunks: int) -> list[torch.Tensor]:
    """Split ``batch`` along its first dimension into ``chunks`` micro-batches (views)."""
    return list(torch.split(batch, micro_batch_sizes(batch.shape[0], chunks)))


def gather(outputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Join micro-batch outputs back into one batch (the inverse of :func:`scatter`)."""
    return torch.cat(list(outputs), dim=0)
