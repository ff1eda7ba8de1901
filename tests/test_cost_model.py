"""The alpha-beta cost model: closed forms, and exact agreement with measured traces."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_par.collectives import ALGORITHMS
from lightning_par.collectives.cost_model import (
    all_gather_cost,
    crossover,
    fit_alpha_beta,
    predict,
    reduce_scatter_cost,
)
from lightning_par.comm import CommTrace, run_on_ranks


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_ring_sends_2_p_minus_1_over_p_n_when_p_divides_n(p):
    n = 840  # divisible by 2..8
    cost = predict("ring", n, p, element_size=4, segment_bytes=None)
    assert cost.bytes_sent == (2 * (p - 1) * n // p * 4,) * p
    assert cost.messages_sent == (2 * (p - 1),) * p
    assert cost.steps == 2 * (p - 1)


def test_ring_uneven_chunks_are_counted_exactly():
    # n = 10, p = 4: chunks 3, 3, 2, 2; rank r skips chunks r+1 (reduce-scatter) and r+2.
    cost = predict("ring", 10, 4, element_size=2, segment_bytes=None)
    sizes = [3, 3, 2, 2]
    expected = tuple((20 - sizes[(r + 1) % 4] - sizes[(r + 2) % 4]) * 2 for r in range(4))
    assert cost.bytes_sent == expected == (30, 32, 30, 28)
    # Fewer elements than ranks: chunks 1, 1, 0, 0; empty chunks send nothing.
    tiny = predict("ring", 2, 4, segment_bytes=None)
    assert sum(tiny.bytes_sent) == 2 * 2 * 3 * 4  # each element travels p-1 hops, twice
    assert tiny.messages_sent == (3, 4, 3, 2)


def test_ring_segments_add_messages_not_bytes():
    whole = predict("ring", 4000, 4, segment_bytes=None)
    cut = predict("ring", 4000, 4, segment_bytes=400)  # 100 floats, 10 segments per chunk
    assert cut.bytes_sent == whole.bytes_sent
    assert cut.messages_sent == tuple(10 * m for m in whole.messages_sent)


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_each_ring_phase_sends_half_the_rings_volume(p):
    n = 840  # divisible by 2..8
    ring = predict("ring", n, p, segment_bytes=None)
    for phase in (reduce_scatter_cost, all_gather_cost):
        cost = phase(n, p, segment_bytes=None)
        assert (
            cost.bytes_sent == tuple(b // 2 for b in ring.bytes_sent) == ((p - 1) * n // p * 4,) * p
        )
        assert cost.messages_sent == (p - 1,) * p and cost.steps == p - 1


def test_ring_phases_uneven_chunks_are_counted_exactly():
    # n = 10, p = 4: chunks 3, 3, 2, 2. The reduce-scatter sends every chunk but the rank's
    # own, the all-gather every chunk but its right neighbour's.
    sizes = [3, 3, 2, 2]
    scatter = reduce_scatter_cost(10, 4, element_size=1, segment_bytes=None)
    gather = all_gather_cost(10, 4, element_size=1, segment_bytes=None)
    assert scatter.bytes_sent == tuple(10 - sizes[r] for r in range(4)) == (7, 7, 8, 8)
    assert gather.bytes_sent == tuple(10 - sizes[(r + 1) % 4] for r in range(4)) == (7, 8, 8, 7)
    # over all ranks the two phases send what the fused ring sends (it starts elsewhere)
    ring = predict("ring", 10, 4, element_size=1, segment_bytes=None)
    assert sum(scatter.bytes_sent) + sum(gather.bytes_sent) == sum(ring.bytes_sent)
    # fewer elements than ranks: chunks 1, 1, 0, 0, and empty chunks send nothing
    assert reduce_scatter_cost(2, 4, segment_bytes=None).messages_sent == (1, 1, 2, 2)
    assert all_gather_cost(2, 4, segment_bytes=None).messages_sent == (1, 2, 2, 1)
    # segments add messages, not bytes (100 floats, 10 segments per chunk)
    cut = reduce_scatter_cost(4000, 4, segment_bytes=400)
    assert cut.bytes_sent == reduce_scatter_cost(4000, 4, segment_bytes=None).bytes_sent
    assert cut.messages_sent == (30,) * 4
    for phase in (reduce_scatter_cost, all_gather_cost):
        assert phase(0, 4).bytes_sent == (0,) * 4 and phase(100, 1).messages_sent == (0,)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_butterfly_power_of_two_sends_n_log2_p(p):
    cost = predict("butterfly", 1000, p, element_size=4)
    assert cost.bytes_sent == (1000 * 4 * int(math.log2(p)),) * p
    assert cost.steps == int(math.log2(p))


def test_butterfly_folds_non_powers_of_two():
    cost = predict("butterfly", 100, 6, element_size=1)  # core of 4, ranks 4, 5 folded
    assert cost.messages_sent == (3, 3, 2, 2, 1, 1)
    assert cost.bytes_sent == (300, 300, 200, 200, 100, 100)
    assert cost.steps == 2 + 2  # fold-in, two rounds, fold-out


def test_tree_of_seven_nodes_takes_two_steps_each_way():
    cost = predict("tree", 1, 7, element_size=1)
    # root sends to 2 children; inner nodes send up once and down twice; leaves up once.
    assert cost.messages_sent == (2, 3, 3, 1, 1, 1, 1)
    assert cost.steps == 4


def test_baselines():
    a2a = predict("all_to_all", 10, 5, element_size=4)
    assert a2a.bytes_sent == (160,) * 5 and a2a.steps == 1
    mw = predict("master_worker", 10, 5, element_size=4)
    assert mw.bytes_sent == (160, 40, 40, 40, 40) and mw.messages_sent == (4, 1, 1, 1, 1)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_nothing_to_send(name):
    assert predict(name, 0, 4).bytes_sent == (0,) * 4
    assert predict(name, 100, 1).messages_sent == (0,)


def test_time_model_shapes():
    alpha, beta = 1e-4, 1e-9
    # Latency-bound: butterfly's log2(p) steps beat the ring's 2(p-1).
    assert predict("butterfly", 1, 8).time(alpha, beta) < predict("ring", 1, 8).time(alpha, beta)
    # Bandwidth-bound: the ring's per-rank traffic hardly grows with p.
    big = 1 << 24
    t4, t8 = (predict("ring", big, p).time(0.0, beta) for p in (4, 8))
    assert t8 / t4 == pytest.approx((2 * 7 / 8) / (2 * 3 / 4), rel=1e-3)
    assert predict("ring", big, 8).time(alpha, beta) < predict("butterfly", big, 8).time(
        alpha, beta
    )
    n = crossover("butterfly", "ring", 8, alpha, beta)
    assert n is not None and 1 < n < big


def test_fit_alpha_beta_recovers_the_line():
    sizes = [1e3, 1e5, 1e6, 4e6]
    alpha, beta = fit_alpha_beta(sizes, [2e-5 + 3e-10 * s for s in sizes])
    assert alpha == pytest.approx(2e-5) and beta == pytest.approx(3e-10)
    with pytest.raises(ValueError, match="at least two"):
        fit_alpha_beta([1.0], [1.0])


def _traced_totals(rank: int, world_size: int, numel: int) -> dict:
    out = {}
    for name, allreduce in ALGORITHMS.items():
        trace = CommTrace(rank)
        allreduce(torch.ones(numel), trace=trace)  # default options
        out[name] = (trace.bytes_sent, trace.messages_sent, trace.steps)
    return out


def test_measured_traffic_equals_the_model_with_default_options():
    numel = 13_000_001  # 17.3 MB ring chunks on 3 ranks: five 4 MiB segments each
    for rank, totals in enumerate(run_on_ranks(_traced_totals, 3, numel)):
        for name, (nbytes, messages, steps) in totals.items():
            cost = predict(name, numel, 3)
            assert nbytes == cost.bytes_sent[rank], name
            assert messages == cost.messages_sent[rank], name
            assert steps <= cost.steps, name


def test_round_robin_sends_the_rings_volume_when_p_divides_n():
    for p in (2, 3, 4, 5, 8):
        rr, ring = predict("round_robin", 840, p), predict("ring", 840, p, segment_bytes=None)
        assert rr.bytes_sent == ring.bytes_sent and rr.messages_sent == ring.messages_sent
        assert rr.steps == ring.steps == 2 * (p - 1)


def test_round_robin_uneven_chunks_are_counted_exactly():
    # n = 10, p = 4: chunks 3, 3, 2, 2. Rank r sends the 3 other chunks to their owners,
    # then its own chunk to the 3 other ranks: 10 - c_r + 3 c_r elements.
    cost = predict("round_robin", 10, 4, element_size=1)
    assert cost.bytes_sent == (16, 16, 14, 14)
    # 2 elements on 4 ranks: chunks 1, 1, 0, 0. Owners of empty chunks receive and send
    # nothing for them; ranks 0 and 1 each send one element to the other and broadcast.
    tiny = predict("round_robin", 2, 4, element_size=1)
    assert tiny.messages_sent == (1 + 3, 1 + 3, 2, 2)
    assert tiny.bytes_sent == (4, 4, 2, 2)
