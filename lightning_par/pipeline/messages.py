"""What crosses between pipeline devices: message kinds and the shape header.

Each kind of message is its own transport tag (:class:`Kind`), so messages of one kind
between two devices are matched in the order they were sent, whatever else is in flight.
Before the first activation message of a (batch shape, micro-batch, stage), the sender sends
a header: the number of tensors of the tuple, then each tensor's rank, dtype and shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

import torch

Tensors = tuple[torch.Tensor, ...]
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.uint8, torch.bool]  # fmt: skip
_MAX_DIMS, _MAX_TENSORS = 8, 8
HEADER_LEN = 1 + _MAX_TENSORS * (2 + _MAX_DIMS)


def as_tuple(value: torch.Tensor | Sequence[torch.Tensor], stage: int) -> Tensors:
    """What a stage returned, as the tuple of tensors that travels (a tensor: a 1-tuple)."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in value):
        return tuple(value)
    raise TypeError(f"stage {stage} returned {type(value).__name__}: a stage maps a tuple of "
                    "tensors to a tensor or a tuple of tensors")  # fmt: skip


class Kind(IntEnum):
    """Message kinds; each is its own transport tag, so each kind is its own queue."""

    ACT = 1
    GRAD = 2
    HEADER = 3
    OUTPUT = 4  # the joined output, sent to every device after the step


def write_header(tensors: Tensors) -> torch.Tensor:
    """The header announcing ``tensors`` (at most 8, each at most 8-d)."""
    if len(tensors) > _MAX_TENSORS:
        raise TypeError(f"a stage may pass at most {_MAX_TENSORS} tensors to the next one")
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = len(tensors)
    for n, t in enumerate(tensors):
        if t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
            raise TypeError(f"cannot send a {t.dim()}-d {t.dtype} tensor between stages")
        base = 1 + n * (2 + _MAX_DIMS)
        header[base], header[base + 1] = t.dim(), _DTYPES.index(t.dtype)
        header[base + 2 : base + 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return header


def read_header(header: torch.Tensor) -> list[tuple[torch.Size, torch.dtype]]:
    """(shape, dtype) of each tensor a header announces."""
    specs = []
    for n in range(int(header[0])):
        base = 1 + n * (2 + _MAX_DIMS)
        ndim, dtype = int(header[base]), _DTYPES[int(header[base + 1])]
        specs.append((torch.Size(header[base + 2 : base + 2 + ndim].tolist()), dtype))
    return specs
