"""Ring allreduce, pipelined: reduce-scatter then all-gather as one stream of segments.

Baidu's ring allreduce (Gibiansky, 2017; Patarasuk & Yuan, "Bandwidth optimal all-reduce
algorithms for clusters of workstations", 2009), the "share-reduce then share-only" phases
of the course slides (003, slides 46-49): every rank sends only to its right neighbour and
receives only from its left one, ``2 (p - 1) / p * n`` elements in all. The step-by-step
version the course draws is :mod:`.ring_textbook`; this one moves the same bytes faster.

In the textbook ring the link and the adder take turns: a chunk arrives, is added, and only
then goes on. Here every chunk is cut into ``k`` segments sized to the message (at most
``segment_bytes``, and at least two once a chunk is worth splitting), and the ``2 (p - 1)``
steps become one stream of ``2 (p - 1) k`` segment iterations, as in gloo's own ring
(``gloo/allreduce.cc``): at iteration ``i`` a rank posts the receive of segment ``i`` and
sends segment ``i``, which is segment ``i - k`` received and added earlier, while segment
``i - 1`` is still in flight. Two receive slots alternate, so the addition of one segment
overlaps the transfer of the next and the link never waits for a whole chunk. Chunk and
step boundaries disappear: the first segments of the all-gather leave while the last ones
of the reduce-scatter are still being added.

The engine, :class:`SegmentRing`, runs a list of steps (:func:`ring_steps`), so it runs
either phase alone as well (:mod:`.ring_phases`: the reduce-scatter and all-gather that
sharded data parallelism needs, Rajbhandari et al., "ZeRO", 2020); :func:`ring_allreduce` is
the two run as one stream.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_par.collectives._common import finish, prepare, scratch_rows
from lightning_par.collectives.ring_plan import (
    ALL_GATHER,
    DEFAULT_SEGMENT_BYTES,
    MIN_SPLIT_BYTES,
    RECEIVES_IN_FLIGHT,
    REDUCE_SCATTER,
    Message,
    RingPlan,
    RingStep,
    plan,
    ring_steps,
    segments_per_chunk,
)
from lightning_par.collectives.ring_textbook import ring_schedule
from lightning_par.comm import CommTrace, Communicator

__all__ = [
    "ALL_GATHER",
    "DEFAULT_SEGMENT_BYTES",
    "MIN_SPLIT_BYTES",
    "RECEIVES_IN_FLIGHT",
    "REDUCE_SCATTER",
    "RingPlan",
    "RingStep",
    "SegmentRing",
    "ring_allreduce",
    "ring_schedule",
    "ring_steps",
    "plan",
    "run_ring",
    "segments_per_chunk",
]


def ring_allreduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    comm: Communicator | None = None,
    trace: CommTrace | None = None,
    segment_bytes: int | None = DEFAULT_SEGMENT_BYTES,
    receives_in_flight: int = RECEIVES_IN_FLIGHT,
    min_split_bytes: int = MIN_SPLIT_BYTES,
) -> torch.Tensor:
    """Sum ``tensor`` in place over the ranks of ``group`` with the pipelined ring: its
    reduce-scatter and all-gather (:func:`ring_steps`) run as one stream of segments.

    Args:
        tensor: any shape and floating dtype; CPU or CUDA.
        group: process group (``None``: default group); or pass ``comm``.
        comm: an existing :class:`~lightning_par.comm.Communicator` (carries its trace).
        trace: record every message here (trace ``step`` = ring step, ``chunk`` = chunk).
        segment_bytes: largest message (see :func:`segments_per_chunk`); ``None`` sends
            each chunk as one message.
        receives_in_flight: receives posted ahead (each with its own buffer); at least 2.
        min_split_bytes: a chunk of fewer than twice this many bytes goes in one message.

    The three last are the machine's to choose: :mod:`.ring_tuning` picks them (by the
    cores each rank has, or timed at start-up) for the strategies and ``bench allreduce``.
    """
    both = (REDUCE_SCATTER, ALL_GATHER)
    run_ring(tensor, both, group, comm, trace, segment_bytes, receives_in_flight, "allreduce",
             min_split_bytes=min_split_bytes)  # fmt: skip
    return tensor


def run_ring(
    tensor: torch.Tensor,
    phases: tuple[str, ...],
    group: dist.ProcessGroup | None,
    comm: Communicator | None,
    trace: CommTrace | None,
    segment_bytes: int | None,
    receives_in_flight: int,
    collective: str,
    min_split_bytes: int = MIN_SPLIT_BYTES,
) -> tuple[Communicator, torch.Tensor | None]:
    """Run ``phases`` of the pipelined ring on ``tensor`` in place (``collective`` names the
    caller in errors). Returns the communicator and the flat view the ring worked on: a
    view of ``tensor``, or, when ``tensor`` is not contiguous, the copy written back to it;
    ``None`` when there was nothing to exchange (one rank, or no elements)."""
    if receives_in_flight < 2:
        raise ValueError(f"receives_in_flight must be >= 2, got {receives_in_flight}")
    comm, flat = prepare(tensor, group, comm, trace, collective)
    if flat is None:
        return comm, None
    shape = (flat.numel(), flat.element_size(), segment_bytes, min_split_bytes, phases)
    SegmentRing(comm, flat, plan(comm.rank, comm.world_size, *shape), receives_in_flight).run()
    finish(tensor, flat)
    return comm, flat


class SegmentRing:
    """One pipelined run of a :class:`~.ring_plan.RingPlan` over ``flat`` on ``comm``: the
    receive slots and the stream of ``len(steps) k`` iterations (the module docstring)."""

    def __init__(self, comm: Communicator, flat: torch.Tensor, plan: RingPlan,
                 receives_in_flight: int) -> None:  # fmt: skip
        p = comm.world_size
        self.comm, self.flat, self.plan = comm, flat, plan
        self.k, self.total = plan.k, len(plan.sends)
        self.right, self.left = (comm.rank + 1) % p, (comm.rank - 1) % p
        # p = 2 on NCCL: one peer on both sides, whose messages NCCL runs on one stream in
        # posting order, so both ranks post (send i, receive i) pairs, the lower rank's send
        # first (see ordered_exchange). Elsewhere receives are posted as far ahead as buffers
        # allow, so a sender is never held up by a receiver that has not asked yet.
        self.paired = p == 2 and comm.backend == "nccl"
        self.depth = 2 if self.paired else min(receives_in_flight, self.total)
        self.slots = scratch_rows(self.depth, plan.slot_len, flat.dtype, flat.device)
        # untraced messages that need no staging skip the Handle (Communicator.post)
        self.lean = comm.trace is None and not comm.needs_staging(flat)
        # receive i: (its work or Handle, this rank's range, where it lands, what it is)
        self.recvs: list[tuple[Any, torch.Tensor, torch.Tensor, Message] | None]
        self.recvs = [None] * self.total
        self.sends: list[tuple[Any, Message]] = []

    def post_recv(self, i: int) -> None:
        m = self.plan.recvs[i]
        if m.stop > m.start:
            # reduce-scatter: into a slot, added later; all-gather: straight into place (no
            # send reads it before: a rank forwards what it received, and its fused
            # reduce-scatter send from there was received before the finished chunk can be)
            own = self.flat[m.start : m.stop]
            target = self.slots[i % self.depth][: m.stop - m.start] if self.plan.reduces[i] else own
            if self.lean:
                work = self.comm.post("recv", target, self.left, m)
            else:
                work = self.comm.irecv(target, self.left, step=m.step, chunk=m.chunk, tag=m.phase)
            self.recvs[i] = (work, own, target, m)

    def complete(self, i: int) -> None:
        """Wait for receive ``i``; in the reduce-scatter add it to this rank's chunk."""
        received = self.recvs[i]
        if received is not None:
            work, own, incoming, m = received
            if self.lean:
                self.comm.complete(work, "recv", self.left, m)
            else:
                work.wait()
            if self.plan.reduces[i]:
                own.add_(incoming)

    def send(self, i: int) -> None:
        m = self.plan.sends[i]
        if m.stop > m.start:
            segment = self.flat[m.start : m.stop]
            if self.lean:
                work = self.comm.post("send", segment, self.right, m)
            else:
                work = self.comm.isend(segment, self.right, step=m.step, chunk=m.chunk, tag=m.phase)
            self.sends.append((work, m))

    def run(self) -> None:
        # Send i carries receive i - k, added. Waiting one receive later than that (lag 2)
        # lets the next segment arrive while this one is added and sent on.
        lag, rank, total = min(self.k, 2), self.comm.rank, self.total
        completed = posted = 0
        for i in range(total):
            while completed <= i - lag:
                self.complete(completed)
                completed += 1
            if self.paired:
                if rank == 0:
                    self.send(i)
                self.post_recv(i)
                if rank == 1:
                    self.send(i)
                continue
            while posted < min(completed + self.depth, total):  # a free buffer for each
                self.post_recv(posted)
                posted += 1
            self.send(i)
        for i in range(completed, total):
            self.complete(i)
        for work, m in self.sends:
            if self.lean:
                self.comm.complete(work, "send", self.right, m)
            else:
                work.wait()
