"""Dynamic work sharing for asynchronous SGD: server 0 hands out batches on demand.

With fixed per-worker shards a straggler holds every epoch back (the others finish their
shard and wait for its last batches), so asynchrony would buy nothing. Here, in one epoch
the workers together make one pass over the data: each worker's DataLoader uses a
:class:`SharedBatchSampler` that asks server 0 for the *number* of the next batch of the
epoch, and every worker derives the same shuffled order of the samples from the epoch and
the seed, so a batch number means the same samples everywhere. A fast worker asks more
often and so takes more batches.

A worker asks with a ``NEXT`` header and server 0 answers with a ``WORK`` message
(:mod:`~lightning_par.paramserver.protocol`). Server 0 (:class:`WorkQueue`) remembers
which batches each worker holds but has not yet trained (the DataLoader fetches one
ahead). A worker's gradient push acknowledges the batches it trained; if a worker is
dropped, its unacknowledged batches are handed out again (first, before any new batch) to
whoever asks next, so every batch is trained once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

import torch

from lightning_par.paramserver.protocol import NONE


class WorkQueue:
    """Server 0's record of an epoch's batches: handed out once each, re-issued if lost."""

    def __init__(self) -> None:
        self.next: dict[int, int] = {}  # epoch -> next fresh batch number
        self.requeued: deque[tuple[int, int]] = deque()  # (epoch, batch) of dropped workers
        self.held: dict[int, list[tuple[int, int]]] = {}  # worker -> issued, not yet trained
        self.issued: list[tuple[int, int, int]] = []  # (worker, epoch, batch), in order

    def take(self, worker: int, epoch: int, num_batches: int) -> tuple[int, int]:
        """The next ``(epoch, batch)`` for ``worker``, or ``(epoch, NONE)`` when the epoch's
        batches are all handed out. Re-issued batches of earlier epochs go first."""
        if self.requeued and self.requeued[0][0] <= epoch:
            item = self.requeued.popleft()
        else:
            k = self.next.get(epoch, 0)
            if k >= num_batches:
                return epoch, NONE
            self.next[epoch] = k + 1
            item = (epoch, k)
        self.held.setdefault(worker, []).append(item)
        self.issued.append((worker, *item))
        return item

    def trained(self, worker: int, epoch: int, batch: int) -> None:
        """``worker`` pushed the gradient of ``(epoch, batch)``: it and every batch handed
        to it before are done (a worker trains its batches in the order it took them)."""
        held = self.held.get(worker, [])
        if (epoch, batch) not in held:
            return
        while held and held.pop(0) != (epoch, batch):
            pass

    def drop(self, worker: int) -> list[tuple[int, int]]:
        """``worker`` is gone: hand its untrained batches to the others; returns them."""
        lost = self.held.pop(worker, [])
        self.requeued.extend(lost)
        return lost


def epoch_order(size: int, epoch: int, seed: int, shuffle: bool) -> torch.Tensor:
    """The sample order of ``epoch``, the same on every worker."""
    if not shuffle:
        return torch.arange(size)
    g = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(size, generator=g)


class SharedBatchSampler:
    """A batch sampler that asks the servers which batch of the epoch to load next.

    It has no length on purpose: a worker does not know how many batches it will get, and
    Lightning then finds the epoch's last batch by fetching one ahead (which keeps
    validation at the epoch's end).

    Args:
        size: samples in the (whole, unsharded) dataset.
        batch_size, drop_last: as the user's DataLoader.
        shuffle, seed: shuffle each epoch with ``seed + epoch`` (the same on every worker).
        request: ``(epoch, num_batches) -> (epoch, batch)``, asking server 0.
    """

    def __init__(
        self, size: int, batch_size: int, drop_last: bool, shuffle: bool, seed: int,
        request: Callable[[int, int], tuple[int, int]],
    ) -> None:  # fmt: skip
        self.size, self.batch_size, self.shuffle, self.seed = size, batch_size, shuffle, seed
        self.num_batches = size // batch_size if drop_last else -(-size // batch_size)
        self.request = request
        self.epoch = 0
        self.taken: list[tuple[int, int]] = []  # (epoch, batch) handed to this worker
        self._orders: dict[int, torch.Tensor] = {}

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def indices(self, epoch: int, batch: int) -> list[int]:
        if epoch not in self._orders:
            self._orders = {epoch: epoch_order(self.size, epoch, self.seed, self.shuffle)}
        start = batch * self.batch_size
        return self._orders[epoch][start : start + self.batch_size].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self.epoch
        while True:
            e, k = self.request(epoch, self.num_batches)
            if k == NONE:
                return
            self.taken.append((e, k))
            yield self.indices(e, k)
