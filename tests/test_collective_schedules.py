"""How the collectives post their messages: to one peer the lower rank sends first, each
round-robin step is a permutation, the pipelined ring keeps receives in flight where the
textbook ring (exact, traffic as the cost model says) keeps one, segments are sized to the
chunk, the two-rank ring and its two phases post in NCCL's order, the phases alone send half
the ring's volume on its links (nothing for one rank or no elements). Their results are
checked against torch's collectives in ``test_collectives.py`` and ``test_ring_phases.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_collectives import sizes_for
from test_ring_phases import SEGMENT_BYTES

from lightning_par.collectives import (
    ALGORITHMS,
    ring_all_gather,
    ring_allreduce,
    ring_reduce_scatter,
)
from lightning_par.collectives.cost_model import predict
from lightning_par.collectives.ring import (
    ALL_GATHER,
    MIN_SPLIT_BYTES,
    REDUCE_SCATTER,
    ring_steps,
    segments_per_chunk,
)
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
    assert segments_per_chunk(10**6, 4, None) == 1  # the textbook ring's one message
    small = MIN_SPLIT_BYTES // 4  # a chunk below two split sizes goes whole
    assert segments_per_chunk(small, 4, 4 << 20) == 1
    assert segments_per_chunk(2 * small, 4, 4 << 20) == 2  # two in flight once worth it
    assert segments_per_chunk(4 << 20, 4, 4 << 20) == 4  # 16 MiB in 4 MiB segments
    assert segments_per_chunk(3, 4, 4) == 3  # never more segments than elements
    for elems in (1, 7, 10**5, 10**7):
        k = segments_per_chunk(elems, 4, 1 << 20)
        assert -(-elems // k) * 4 <= max(1 << 20, 4) and 1 <= k <= elems


class _Handle:
    def wait(self) -> None:
        pass


class _Recorder:
    """A communicator that records what is posted, sending nothing."""

    trace, group = None, None

    def __init__(self, rank: int, world_size: int = 2, backend: str = "nccl") -> None:
        self.rank, self.world_size, self.backend, self.posted = rank, world_size, backend, []

    def isend(self, tensor, peer, **kw):
        self.posted.append("send")
        return _Handle()

    def irecv(self, tensor, peer, **kw):
        self.posted.append("recv")
        return _Handle()

    def needs_staging(self, tensor) -> bool:
        return False

    def post(self, op, tensor, peer, what):  # the untraced path (Communicator.post)
        self.posted.append(op)
        return _Handle()

    def complete(self, work, op, peer, what) -> None:
        work.wait()


def test_the_two_rank_ring_posts_in_nccl_order():
    # With p = 2 both neighbours are one peer; NCCL runs that pair's messages on one
    # stream in posting order, so at every position one rank must send while the other
    # receives (else both wait in a receive). Recorded with a fake communicator.
    ranks = [_Recorder(0), _Recorder(1)]
    for comm in ranks:
        ring_allreduce(torch.ones(3 << 20), comm=comm, segment_bytes=1 << 20)
    low, high = ranks[0].posted, ranks[1].posted
    assert len(low) == len(high) == 2 * 2 * 6  # 2 steps of 6 segments, a send and a receive
    assert all({a, b} == {"send", "recv"} for a, b in zip(low, high))


@pytest.mark.parametrize("phase", [ring_reduce_scatter, ring_all_gather])
def test_the_two_rank_phases_post_in_nccl_order(phase):
    # With p = 2 both neighbours are one peer; NCCL runs that pair's messages on one stream
    # in posting order, so at every position one rank must send while the other receives.
    ranks = [_Recorder(0), _Recorder(1)]
    for comm in ranks:
        phase(torch.ones(3 << 20), comm=comm, segment_bytes=1 << 20)
    low, high = ranks[0].posted, ranks[1].posted
    assert len(low) == len(high) == 2 * 6  # one step of 6 segments, a send and a receive
    assert all({a, b} == {"send", "recv"} for a, b in zip(low, high))


def test_one_rank_or_no_elements_leave_the_tensor_as_it_is():
    alone = torch.arange(6.0).reshape(2, 3)
    chunk = ring_reduce_scatter(alone, comm=_Recorder(0, world_size=1))
    assert torch.equal(chunk, torch.arange(6.0)) and chunk.data_ptr() == alone.data_ptr()
    assert ring_all_gather(alone, comm=_Recorder(0, world_size=1)) is alone
    empty, comm = torch.empty(0), _Recorder(1, world_size=3)
    assert ring_reduce_scatter(empty, comm=comm).shape == (0,)
    assert ring_all_gather(empty, comm=comm) is empty and comm.posted == []


@pytest.mark.parametrize("p", range(2, 8))
def test_the_phases_alone_end_with_rank_r_owning_chunk_r_on_the_rings_links(p):
    fused = [ring_steps(r, p, (REDUCE_SCATTER, ALL_GATHER)) for r in range(p)]
    for phase in (REDUCE_SCATTER, ALL_GATHER):
        alone = [ring_steps(r, p, (phase,)) for r in range(p)]
        for s in range(p - 1):  # what rank r sends at step s, its right neighbour receives
            assert all(alone[r][s][1] == alone[(r + 1) % p][s][2] for r in range(p))
    for r in range(p):
        # the reduce-scatter's last addition is chunk r; the all-gather first sends chunk r
        assert ring_steps(r, p, (REDUCE_SCATTER,))[-1][2] == r
        assert ring_steps(r, p, (ALL_GATHER,))[0][1] == r
        assert fused[r][p - 2][2] == fused[r][p - 1][1] == (r + 1) % p  # the fused ring's
    with pytest.raises(ValueError, match="reduce-scatter, all-gather or both"):
        ring_steps(0, p, (ALL_GATHER, REDUCE_SCATTER))


def _volume(rank: int, p: int, numel: int) -> dict[str, tuple[int, int]]:
    out = {}
    for name, fn in (("allreduce", ring_allreduce), ("reduce-scatter", ring_reduce_scatter),
                     ("all-gather", ring_all_gather)):  # fmt: skip
        trace = CommTrace(rank)
        fn(torch.ones(numel), trace=trace, segment_bytes=SEGMENT_BYTES)
        out[name] = (trace.bytes_sent, trace.messages_sent)
    return out


@pytest.mark.parametrize("p", [2, 3, 4])
def test_each_phase_sends_half_the_allreduce_in_p_minus_1_times_k_messages(p):
    numel = 5004  # p divides it; its float chunks are several 1 KiB segments each
    k = segments_per_chunk(numel // p, 4, SEGMENT_BYTES)
    assert k > 1
    for volume in run_on_ranks(_volume, p, numel):
        allreduce_bytes, _ = volume["allreduce"]
        for phase in ("reduce-scatter", "all-gather"):
            nbytes, messages = volume[phase]
            assert nbytes == (p - 1) * numel // p * 4 == allreduce_bytes // 2, phase
            assert messages == (p - 1) * k, phase
