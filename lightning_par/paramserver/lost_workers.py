"""Workers lost during a fault-tolerant synchronous run: the servers' side.

With ``fault_tolerant=True`` a worker may be lost (killed, or frozen and then killed by the
heartbeat of a peer): every receive from it fails at once, as its connections close. *The
leader* below is the first live worker: worker 0, or the first survivor once worker 0 is
lost (:attr:`LostWorkers.leader`; the workers agree,
:attr:`~.missing_pushes.MissingPushes.leader`). The weights must still be those of one
process on the whole batch, so every step's update still averages the gradients of all
``W`` shards of the batch, each exactly once:

* a server keeps the pushes it received: a bucket every worker pushed is applied and sent
  back as usual (a worker lost after pushing it cost nothing there);
* once the step's pushes are in, each shard tells every live worker which lost workers'
  pushes it lacks (``MISSING``, empty when nothing is missing); no worker writes any pulled
  weight before it has every shard's ``MISSING``, so the weights it holds are still those
  the step began with, the lost worker's own;
* the leader then computes each missing worker's gradient on that worker's batch (Lightning's
  ``DistributedSampler`` read again with the lost rank's number) and pushes it in its place,
  bucket by bucket; the shard completes the buckets that lacked it, applies them and sends
  them back;
* a frozen worker is found silent by a peer's heartbeat and ended where it runs on the
  same machine (:func:`let_go_silent`), so that its connections close as a killed one's;
* from the next step on, the leader trains the lost worker's batch beside its own and pushes
  that gradient in the lost worker's slot, a push of its own after the leader's, bucket by
  bucket; it says so in the job's store before it sends that step's header
  (:func:`~.faults.record_covered`), so a server that finds the worker lost only then takes
  that slot's push from the leader. The servers still divide by ``W``: no loss is rescaled.

Every bucket's pushes are summed in worker order, whoever sent them, as
:func:`~.server.synchronous_step` sums them without a loss: float addition is not
associative, so the leader pushing the sum of its own and a lost worker's gradient, or a
server adding a missing push last, would give other last bits (with three workers, the
weights of the CIFAR CNN drifted to 3e-5 of the run without the loss in 25 steps), where
this keeps them equal, bit for bit.

This is the redo of torchft's and our allreduce strategies'
(:mod:`lightning_par.components.fault_tolerance`) reduced to what a parameter server needs:
the servers hold every push of the step, so only the lost worker's part is computed again,
and no process group is re-formed (gloo fails only the lost worker's connections).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from lightning_par.comm import CommError, Communicator, Handle
from lightning_par.launch.heartbeat import Heartbeat
from lightning_par.paramserver import protocol
from lightning_par.paramserver.faults import covered_since
from lightning_par.paramserver.messages import recv_object_bytes
from lightning_par.paramserver.protocol import Header, Kind
from lightning_par.paramserver.server import ShardOptimizer, apply_averaged

Replicate = Callable[[int, torch.Tensor, torch.Tensor], None]


class _Failed:
    """A receive that failed as it was posted (a lost worker's): fails when waited for."""

    def __init__(self, error: CommError) -> None:
        self.error = error

    def wait(self, timeout: object = None) -> torch.Tensor:
        raise self.error


class LostWorkers:
    """The workers one shard's server found lost, and the step from which the leader trains
    each one's batch (see the module docstring)."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.lost: set[int] = set()
        self._covered_from: dict[int, int] = {}

    @property
    def live(self) -> list[int]:
        return [w for w in range(self.num_workers) if w not in self.lost]

    @property
    def leader(self) -> int:
        """The worker that stands in for the lost ones: the first live one (worker 0 until
        it is lost; the workers agree, :attr:`~.missing_pushes.MissingPushes.leader`)."""
        return self.live[0]

    def lose(self, worker: int, error: CommError) -> None:
        """A message from or to ``worker`` failed: it is lost (the last one: the job ends)."""
        if self.live == [worker]:
            raise error
        self.lost.add(worker)

    def covered(self, worker: int, step: int) -> bool:
        """Whether the leader pushes lost ``worker``'s gradient of ``step`` in its slot."""
        first = self._covered_from.get(worker)
        if first is None:
            first = covered_since(worker)
            if first is not None:
                self._covered_from[worker] = first
        return first is not None and first <= step

    def headers(self, comm: Communicator, num_hyper: int, idle, tag) -> Header:
        """The next header of every live worker (the first's waited for up to ``idle``, as
        :func:`~.messages.recv_headers` does); a worker whose header fails is lost.
        Returns the first live one's."""
        live = self.live
        buffers = {w: Header.buffer(num_hyper) for w in live}
        handles = {w: self._post(comm, buffers[w], w, tag=tag) for w in live}
        first = None
        for w in live:
            try:
                handles[w].wait(idle if first is None else None)
            except CommError as err:
                self.lose(w, err)
                continue
            header = Header.decode(buffers[w], num_hyper, f"worker {w} (rank {w})")
            if first is None:
                first = header
            elif header.command != first.command:
                raise RuntimeError(
                    f"parameter server rank {comm.rank}: workers disagree on the command "
                    f"({first.command.name}, {header.command.name}); they must call the same "
                    "hooks in step"
                )
        assert first is not None  # (losing the last live worker raised)
        return first

    def _post(self, comm: Communicator, buffer: torch.Tensor, worker: int, **kw) -> Handle:
        """A receive from ``worker``; one from a worker whose connection closed already
        fails as it is posted: it fails again when waited for, as a receive that found the
        closed connection later does."""
        try:
            return comm.irecv(buffer, worker, **kw)
        except CommError as err:
            return _Failed(err)

    def object_bytes(self, comm: Communicator, tag) -> tuple[torch.Tensor, torch.Tensor]:
        """The object every live worker sends (a state to load: the same in each), the first
        one's: each sends it, so that none waits on a leader it has not found lost yet."""
        received = []
        for w in self.live:
            try:
                received.append(recv_object_bytes(comm, w, tag=tag))
            except CommError as err:
                self.lose(w, err)
        return received[0]

    def wait_sends(self, sends: list[tuple[int, Handle]]) -> None:
        """Wait for messages to workers; one to a worker lost meanwhile is let go."""
        for worker, handle in sends:
            try:
                handle.wait()
            except CommError as err:
                self.lose(worker, err)

    def send(self, comm: Communicator, message: torch.Tensor, worker: int, tag, **kw) -> None:
        """Send ``message`` to ``worker``, which may be lost meanwhile."""
        self.wait_sends([(worker, comm.isend(message, worker, tag=tag, **kw))])

    def step(
        self, comm: Communicator, shard: ShardOptimizer, step: int,
        replicate: Replicate | None = None, applied: frozenset[int] = frozenset(),
    ) -> None:  # fmt: skip
        """:func:`~.server.synchronous_step` over every worker's slot, a lost worker's push
        taken from the leader (worker 0 until it is lost; see the module docstring); each
        bucket's pushes summed in worker order, whoever sent them, so the sum is the one
        without the loss, bit for bit."""
        tag = shard.tag(Kind.PUSH)
        covered = {w for w in self.lost if self.covered(w, step)}  # pushed by the leader
        # from which bucket (its position in shard.active) each lost worker's push is missing
        missing = {w: 0 for w in sorted(self.lost - covered)}
        sender = {w: self.leader if w in covered else w
                  for w in range(shard.spec.num_workers) if w not in missing}  # fmt: skip
        # (from the leader: bucket by bucket, its own push, then the covered workers' in
        # order: the receives from one sender are matched in the order they are posted)
        slots = sorted(sender, key=lambda w: (sender[w], w != sender[w], w))
        recvs = {
            b: {w: self._post(comm, shard.push_buffer(b), sender[w], step=step, chunk=b, tag=tag)
                for w in slots}
            for b in shard.active
        }  # fmt: skip
        whole = shard.spec.clip is not None and shard.spec.clip.algorithm == "norm"
        parts: dict[int, dict[int, torch.Tensor]] = {b: {} for b in shard.active}
        sends: list[tuple[int, Handle]] = []
        for i, b in enumerate(shard.active):
            for w in slots:
                if w in missing:
                    continue
                try:
                    parts[b][w] = recvs[b][w].wait()
                except CommError as err:
                    self.lose(sender[w], err)
                    missing[w] = i
            if not missing and not whole:
                sends += self._apply(comm, shard, step, {b: _in_order(parts[b])}, replicate,
                                     applied)  # fmt: skip
        status = protocol.encode_missing(list(missing), shard.spec.num_workers)
        for w in self.live:
            self.send(comm, status, w, shard.tag(Kind.MISSING), step=step)
        leader = self.leader  # sends each one's gradient, every bucket
        for w in sorted(missing):
            for i, b in enumerate(shard.active):
                part = comm.recv(shard.push_buffer(b), leader, step=step, chunk=b, tag=tag)
                if i >= missing[w]:
                    parts[b][w] = part
            self._covered_from[w] = step + 1
        # (by norm nothing was applied yet; else the buckets from the first one missing)
        first = 0 if whole else min(missing.values(), default=len(shard.active))
        rest = {b: _in_order(parts[b]) for b in shard.active[first:]}
        sends += self._apply(comm, shard, step, rest, replicate, applied)
        self.wait_sends(sends)

    def _apply(
        self, comm: Communicator, shard: ShardOptimizer, step: int,
        totals: dict[int, torch.Tensor], replicate: Replicate | None, applied: frozenset[int],
    ) -> list[tuple[int, Handle]]:  # fmt: skip
        """Average, clip and apply the summed pushes ``totals``, hand each update to the
        backup, post the new slices to every live worker."""
        if not totals:
            return []
        workers = shard.spec.num_workers
        grads = {}
        for b, total in totals.items():
            grad, used = shard.decode_push(b, total)
            grads[b] = (grad.div_(workers), used)
        apply_averaged(comm, shard, grads, step, applied)
        for b, (grad, used) in grads.items():
            if replicate is not None and b not in applied:
                replicate(b, grad, used)
        live = self.live
        return [(w, h) for b in grads for w, h in zip(live, shard.send_slices(comm, b, live, step))]


def _in_order(parts: dict[int, torch.Tensor]) -> torch.Tensor:
    """The sum of one bucket's pushes ``parts`` (worker -> push), in worker order as
    :func:`~.server.synchronous_step` sums them: float addition is not associative, so
    ``(g0 + g2) + g1`` may differ from ``(g0 + g1) + g2`` in the last bit."""
    workers = sorted(parts)
    total = parts[workers[0]].clone()
    for w in workers[1:]:
        total += parts[w]
    return total


# ---- a silent worker (frozen): ended, so that its connections close --------------------------
def let_go_silent(
    beat: Heartbeat, num_workers: int, zero: bool, peer: int, report: str
) -> bool:  # fmt: skip
    """``fault_tolerant``: whether the job goes on without silent ``peer``: a server; a
    worker other than 0, or worker 0 too if ``zero`` (its servers outlive it), killed first
    where it runs on this machine, so that its connections close and the others' messages
    to it fail at once."""
    if (peer > 0 or zero) and peer < num_workers:
        end_silent_worker(beat, peer, report)
    return peer != 0 or zero


#: Who found a silent worker first (``fault_tolerant``): the one process that says so.
SILENT_KEY = "lightning_par/paramserver/silent/{}"


def end_silent_worker(beat: Heartbeat, peer: int, report: str) -> None:
    """SIGKILL silent worker ``peer`` of ``beat``'s group if it runs on this machine; the
    first process to find it silent says so (``report``: who, for how long). One whose
    process ended already is not silent but lost, and its launcher says so: a worker
    killed is found silent too once the run outlasts ``dead_peer_timeout`` after it."""
    process = beat.peers.get(peer)
    if process is not None and process.local:
        if process.ended():
            return
        beat.killing(peer)
        process.kill()
    me = str(beat.rank)
    first = beat.safely(lambda: beat.store.compare_set(SILENT_KEY.format(peer), "", me))
    if first is not None and first.decode() == me:
        print(f"lightning_par: {report}; it is ended and the others go on without it",
              file=sys.stderr, flush=True)  # fmt: skip


__all__ = ["LostWorkers", "end_silent_worker", "let_go_silent"]
