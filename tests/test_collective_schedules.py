"""How the collectives post their messages: to one peer the lower rank sends first, each
round-robin step is a permutation, the pipelined ring keeps receives in flight where the
textbook ring (exact, traffic as the cost model says) keeps one, segments are sized to the
chunk, and the two-rank ring posts in NCCL's order. Their sums are checked against
``torch.distributed.all_reduce`` in ``test_collectives.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_collectives import sizes_for

from lightning_par.collectives import ALGORITHMS, ring_allreduce
from lightning_par.collectives.cost_model import predict
from lightning_par.comm import CommTrace, run_on_ranks


def test_exchanges_with_one_peer_are_posted_lower_rank_sending_first():
    # NCCL runs both directions between two ranks on one stream in posting order: if both
    # posted their send first, large messages would deadlock. Checked without a GPU.
    from lightning_par.collectives._common import ordered_exchange

    class Recorder:
        def __init__(self, rank):
            self.rank, self.posted = rank, []

        def isend(self, tensor, peer, **kw):
            self.posted.append(("send", peer))

        def irecv(self, tensor, peer, **kw):
            self.posted.append(("recv", peer))

    t = torch.zeros(1)
    low, high = Recorder(0), Recorder(1)
    ordered_exchange(low, [(t, {}), (t, {})], [(t, {})], 1)
    ordered_exchange(high, [(t, {})], [(t, {}), (t, {})], 0)
    assert low.posted == [("send", 1), ("send", 1), ("recv", 1)]
    assert high.posted == [("recv", 0), ("recv", 0), ("send", 0)]


def test_round_robin_steps_are_permutations():
    # In every step each rank receives from exactly one rank, and it is the rank that
    # sends to it: no rank's link is asked to take two messages in one step.
    from lightning_par.collectives.round_robin import round_robin_schedule

    for p in range(2, 9):
        schedules = [round_robin_schedule(r, p) for r in range(p)]
        for step in range(2 * (p - 1)):
            sends = {r: schedules[r][step][0] for r in range(p)}
            assert sorted(sends.values()) == list(range(p)), (p, step)
            for r in range(p):
                dst, sent_chunk, _, _ = schedules[r][step]
                _, _, src, got_chunk = schedules[dst][step]
                assert src == r and got_chunk == sent_chunk, (p, step, r)


def _textbook_and_overlap(rank: int, world_size: int) -> list:
    from lightning_par.collectives.ring_textbook import textbook_ring_allreduce

    problems = []
    for numel in sizes_for(world_size):
        g = torch.Generator().manual_seed(31 * rank + numel)
        x = torch.randint(-8, 9, (numel,), generator=g).float()
        expected = x.clone()
        dist.all_reduce(expected)
        trace = CommTrace(rank)
        if not torch.equal(textbook_ring_allreduce(x.clone(), trace=trace), expected):
            problems.append(("textbook", numel, "sum differs"))
        model = predict("ring", numel, world_size, segment_bytes=None)
        if (trace.bytes_sent, trace.messages_sent) != (
            model.bytes_sent[rank],
            model.messages_sent[rank],
        ):
            problems.append(("textbook", numel, "traffic differs from the model"))
    # In flight at once: the pipelined ring posts receive i + 1 before it waits for
    # receive i; the textbook ring never has two receives open.
    x = torch.ones(30_000)
    overlaps = {}
    for name, fn in (("pipelined", ALGORITHMS["ring"]), ("textbook", None)):
        trace = CommTrace(rank)
        if fn is None:
            from lightning_par.collectives.ring_textbook import textbook_ring_allreduce as fn
        kw = {"segment_bytes": 8192} if name == "pipelined" else {}
        fn(x.clone(), trace=trace, **kw)
        recvs = sorted((m.start, m.end) for m in trace.messages if m.op == "recv")
        overlaps[name] = sum(1 for a, b in zip(recvs, recvs[1:]) if b[0] < a[1])
    return [problems, overlaps]


@pytest.mark.parametrize("world_size", [2, 3])
def test_textbook_ring_is_exact_and_the_pipelined_ring_overlaps(world_size):
    for rank, (problems, overlaps) in enumerate(
        run_on_ranks(_textbook_and_overlap, world_size, timeout=60)
    ):
        assert problems == [], (rank, problems)
        assert overlaps["textbook"] == 0, rank
        # 30 000 floats / p chunks of 8 KiB segments: many receives, each posted early
        assert overlaps["pipelined"] >= 2 * (world_size - 1), (rank, overlaps)


def test_segments_are_sized_to_the_chunk():
    from lightning_par.collectives.ring import MIN_SPLIT_BYTES, segments_per_chunk

    assert segments_per_chunk(10**6, 4, None) == 1  # the textbook ring's one message
    small = MIN_SPLIT_BYTES // 4  # a chunk below two split sizes goes whole
    assert segments_per_chunk(small, 4, 4 << 20) == 1
    assert segments_per_chunk(2 * small, 4, 4 << 20) == 2  # two in flight once worth it
    assert segments_per_chunk(4 << 20, 4, 4 << 20) == 4  # 16 MiB in 4 MiB segments
    assert segments_per_chunk(3, 4, 4) == 3  # never more segments than elements
    for elems in (1, 7, 10**5, 10**7):
        k = segments_per_chunk(elems, 4, 1 << 20)
        assert -(-elems // k) * 4 <= max(1 << 20, 4) and 1 <= k <= elems


def test_the_two_rank_ring_posts_in_nccl_order():
    # With p = 2 both neighbours are one peer; NCCL runs that pair's messages on one
    # stream in posting order, so at every position one rank must send while the other
    # receives (else both wait in a receive). Recorded with a fake communicator.
    class Handle:
        def wait(self):
            pass

    class Recorder:
        world_size, trace, group, backend = 2, None, None, "nccl"

        def __init__(self, rank):
            self.rank, self.posted = rank, []

        def isend(self, tensor, peer, **kw):
            self.posted.append("send")
            return Handle()

        def irecv(self, tensor, peer, **kw):
            self.posted.append("recv")
            return Handle()

        def needs_staging(self, tensor):
            return False

        def post(self, op, tensor, peer, what):  # the untraced path (Communicator.post)
            self.posted.append(op)
            return Handle()

        def complete(self, work, op, peer, what):
            work.wait()

    ranks = [Recorder(0), Recorder(1)]
    for comm in ranks:
        ring_allreduce(torch.ones(3 << 20), comm=comm, segment_bytes=1 << 20)
    low, high = ranks[0].posted, ranks[1].posted
    assert len(low) == len(high) == 2 * 2 * 6  # 2 steps of 6 segments, a send and a receive
    assert all({a, b} == {"send", "recv"} for a, b in zip(low, high))
