"""The messages only fault-tolerant servers exchange (``fault_tolerant=True``; the protocol
as a whole: :mod:`lightning_par.paramserver.protocol`, the algorithm:
:mod:`lightning_par.paramserver.replication`). Each travels on its shard's tag
(:class:`~.header.ShardTag`):

* ``UPDATE`` (primary to backup): the averaged, clipped gradient a primary applied to one
  bucket of its shard and the "has a gradient" flags, in a ``PUSH``'s layout, so the backup
  applies the very same update;
* ``ACK`` (backup to primary): int64 ``[record, bucket]``, the backup holds that record (or
  that bucket of a step; ``NONE``: the whole record);
* ``RECOVER``: int64 ``[n]``: from a worker to the new holder of a lost server's shard, the
  request the worker waits for an answer to; back, the last request the holder's copy
  holds whole;
* ``DONE``: int64 ``[n]``, the answer to request ``n`` when it returns no data;
* ``MISSING`` (holder to each live worker, once a step's pushes are in): int64 ``[W]``, 1
  for each lost worker whose push of the step the shard lacks (worker 0 then sends that
  worker's gradient in its place: :mod:`lightning_par.paramserver.lost_workers`).

Requests are numbered per worker from 0 (the initial weights), one per header after it.
"""

from __future__ import annotations

import torch

from lightning_par.paramserver.protocol.header import Kind
from lightning_par.paramserver.protocol.payloads import decode_push, expect


def encode_update(grad: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """An ``UPDATE``: the gradient a primary applied to one bucket (flat), then its
    "has a gradient" flags (1.0/0.0): a ``PUSH``'s layout."""
    return torch.cat([grad.flatten(), used.to(grad.dtype)])


def decode_update(message: torch.Tensor, num_elements: int, num_slices: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The gradient and the mask of a received ``UPDATE``."""
    return decode_push(message, num_elements, num_slices, Kind.UPDATE)


def _ints(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def encode_ack(record: int, bucket: int) -> torch.Tensor:
    return _ints(record, bucket)


def ack_buffer() -> torch.Tensor:
    return _ints(0, 0)


def decode_ack(message: torch.Tensor) -> tuple[int, int]:
    expect(message, Kind.ACK, (torch.int64,), 2)
    record, bucket = message.tolist()
    return int(record), int(bucket)


def encode_count(count: int) -> torch.Tensor:
    """A ``RECOVER`` or ``DONE``: one request's number."""
    return _ints(count)


def count_buffer() -> torch.Tensor:
    return _ints(0)


def decode_count(message: torch.Tensor, kind: Kind) -> int:
    """The request number of a received ``RECOVER`` or ``DONE`` (``kind``)."""
    expect(message, kind, (torch.int64,), 1)
    return int(message)


def encode_missing(missing: list[int], num_workers: int) -> torch.Tensor:
    """A ``MISSING``: one flag per worker, 1 for the lost workers whose push is missing."""
    flags = torch.zeros(num_workers, dtype=torch.int64)
    flags[list(missing)] = 1
    return flags


def missing_buffer(num_workers: int) -> torch.Tensor:
    return torch.zeros(num_workers, dtype=torch.int64)


def decode_missing(message: torch.Tensor, num_workers: int) -> list[int]:
    """The workers a received ``MISSING`` names (ascending)."""
    expect(message, Kind.MISSING, (torch.int64,), num_workers)
    return [w for w, flag in enumerate(message.tolist()) if flag]
