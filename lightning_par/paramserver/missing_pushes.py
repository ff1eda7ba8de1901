"""Lost workers, a worker's side (``fault_tolerant=True``; the servers' side and the whole
scheme: :mod:`.lost_workers`).

After each step's pushes every shard tells every live worker which lost workers' pushes it
lacks (``MISSING``). :class:`MissingPushes` reads every shard's answer before the worker
writes any pulled weight, so the weights it holds are still those the step began with; then
the leader (the first live worker: worker 0, or the first survivor once worker 0 is lost)
computes each missing worker's gradient on that worker's batch (``fill``, given by the
strategy, which alone can read a batch) and pushes it in its place, bucket by bucket,
and from the next step on trains those workers' batches beside its own (:attr:`lost`),
pushing each one's gradient in that worker's slot right after its own push of the bucket
(:meth:`MissingPushes.keep`, :meth:`MissingPushes.push_kept`): the servers sum every slot
in worker order, as without the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_par.comm import CommError, Communicator
from lightning_par.paramserver import protocol
from lightning_par.paramserver.faults import record_covered
from lightning_par.paramserver.protocol import Kind, ShardTag

#: ``fill(step, workers)``: each lost worker's gradient of ``step`` on its own batch, one
#: entry per trainable parameter (None: unused), with the weights the step began with
Fill = Callable[[int, list[int]], dict[int, list[torch.Tensor | None]]]


class MissingPushes:
    """One worker's reading of the shards' ``MISSING`` answers, and the leader's pushes in
    the lost workers' place (see the module docstring).

    Args:
        comm, links: the worker's communicator and its links to the shards (whose holders
            may move: ``links.servers``, ``links.lock``).
        num_workers, rank: ``W`` and this worker.
        recover: ``recover(shard, error, holder)``: a message from ``holder`` failed.
        name: who says that nothing computes the lost workers' gradients.
    """

    def __init__(
        self, comm: Communicator, links: Any, num_workers: int, rank: int,
        recover: Callable[[int, CommError, int], None], name: str,
    ) -> None:  # fmt: skip
        self.comm, self.links, self.num_workers, self.rank = comm, links, num_workers, rank
        self.recover, self.name = recover, name
        self.fill: Fill | None = None
        #: the workers lost so far, in the order this worker learned of them
        self.lost: list[int] = []
        #: while the leader computes the lost workers' gradients (no pull is waited for then)
        self.filling = False
        self._due: set[int] = set()  # shards whose MISSING of the step is unread
        self._read: dict[int, list[int]] = {}  # read as a moved shard answered again
        self._step = 0
        #: the leader: the lost workers' gradients of the step it trains their batches in
        self._kept: tuple[int, dict[int, list[torch.Tensor | None]]] | None = None

    @property
    def leader(self) -> int:
        """The worker that stands in for the lost ones: the first live one (the servers
        agree, :attr:`~.lost_workers.LostWorkers.leader`)."""
        return next(w for w in range(self.num_workers) if w not in self.lost)

    def expect(self, shards: int, step: int) -> None:
        """Step ``step``'s header went to the ``shards``: each will answer ``MISSING``."""
        self._due, self._read, self._step = set(range(shards)), {}, step

    def read(self, next_step: int) -> None:
        """Every shard's ``MISSING`` of the step (once); the leader pushes what is missing,
        which it trains itself from ``next_step`` on."""
        if not self._due:
            return
        missing: dict[int, list[int]] = {}
        links = self.links
        links.waiting = True  # (clipping by norm: the watch may move a shard meanwhile)
        try:
            while self._due:  # (a shard that moves is answered again: read there)
                s = min(self._due)
                holder = links.servers[s]
                try:
                    found = self._recv(s, holder)
                except CommError as err:
                    self.recover(s, err, holder)
                    continue
                with links.lock:
                    if links.servers[s] == holder:  # (else read from its new holder)
                        self._due.discard(s)
                        missing[s] = found
        finally:
            links.waiting = False
        missing.update(self._read)
        lost = sorted({w for ws in missing.values() for w in ws})
        self.lost += [w for w in lost if w not in self.lost]
        if lost and self.rank == self.leader:  # (worker 0, or the first survivor)
            self._push_in_place(lost, missing, next_step)

    def read_again(self, s: int, holder: int) -> None:
        """Shard ``s`` moved to ``holder``, whose answer to the step ends with a ``MISSING``
        (its send waits until it is read)."""
        self._due.discard(s)
        self._read[s] = self._recv(s, holder)

    def _recv(self, s: int, holder: int) -> list[int]:
        buffer = protocol.missing_buffer(self.num_workers)
        self.comm.recv(buffer, holder, tag=ShardTag(Kind.MISSING, s))
        return protocol.decode_missing(buffer, self.num_workers)

    def _push_in_place(self, lost: list[int], missing: dict[int, list[int]], next_step: int
                       ) -> None:  # fmt: skip
        if self.fill is None:
            raise RuntimeError(f"{self.name}: worker(s) {lost} lost, and nothing computes "
                               "their gradients (MissingPushes.fill is not set)")  # fmt: skip
        self.filling = True
        try:
            grads = self.fill(self._step, lost)
        finally:
            self.filling = False
        plan, step = self.links.plan, self._step
        for s, workers in missing.items():
            sends = [
                (s, self.links.send(self._push_of(grads[w], b, s), s, Kind.PUSH, step, b))
                for w in workers for b in range(len(plan.buckets)) if s in plan.servers_of(b)
            ]  # fmt: skip
            self.links.wait_sends(sends)
        for w in lost:  # before the next step's header: from then on pushed in their slots
            record_covered(w, next_step)

    def keep(self, step: int, grads: dict[int, list[torch.Tensor | None]]) -> None:
        """Worker 0: the lost workers' gradients of ``step`` (one entry each, of every one
        in :attr:`lost`), pushed in their slots as its own push of each bucket goes."""
        if sorted(grads) != sorted(self.lost):
            raise RuntimeError(
                f"{self.name}: worker {self.rank} computed the gradients of workers "
                f"{sorted(grads)}, "
                f"but workers {sorted(self.lost)} are lost"
            )
        self._kept = (step, grads)

    def push_kept(self, b: int, step: int) -> list:
        """Worker 0, right after its own push of bucket ``b`` of ``step``: each lost worker's
        gradient of it, in that worker's slot (the sends, not waited for). Every shard takes
        them from the leader in this order: its own push, then the lost workers' in order."""
        if self.rank != self.leader or not self.lost:
            return []
        if self._kept is None or self._kept[0] != step:
            raise RuntimeError(f"{self.name}: worker {self.rank} trains lost workers "
                               f"{self.lost}, but no gradient of theirs was computed for step "
                               f"{step}")  # fmt: skip
        grads, plan = self._kept[1], self.links.plan
        return [(s, self.links.send(self._push_of(grads[w], b, s), s, Kind.PUSH, step, b))
                for w in sorted(grads) for s in plan.servers_of(b)]  # fmt: skip

    def _push_of(self, grads: list[torch.Tensor | None], b: int, s: int) -> torch.Tensor:
        """A ``PUSH`` of bucket ``b`` to shard ``s`` holding the gradients ``grads``."""
        parts, flags = [], []
        for _, piece in self.links.plan.slices[b][s]:
            grad = grads[piece.param]
            used = grad is not None
            flat = (grad if used else torch.zeros_like(self.links.params[piece.param])).detach()
            parts.append(flat.flatten()[piece.start : piece.stop])
            flags.append(torch.tensor(float(used), dtype=flat.dtype))
        return protocol.encode_push(parts, flags)


__all__ = ["Fill", "MissingPushes"]
