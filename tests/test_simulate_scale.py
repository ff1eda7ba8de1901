"""Scale-out graphs on hand-made profiles: step times worked out by hand from the schedule."""

from __future__ import annotations

import pytest

from lightning_par.simulate.links import Link, Topology
from lightning_par.simulate.profile import Profile
from lightning_par.simulate.scale import NotApplicable, predict_step, scaling_row

LATENCY_ONLY = Topology(Link("a", alpha=1.0, beta=0.0), Link("a", alpha=1.0, beta=0.0))
BANDWIDTH_ONLY = Topology(Link("b", alpha=0.0, beta=1e-3), Link("b", alpha=0.0, beta=1e-3))


def dp(family: str = "allreduce", **kw) -> Profile:
    base = dict(strategy="x", family=family, world=2, processes=2, global_batch=8, step_s=0.0,
                compute_s=10.0, batch_s=10.0, grad_bytes=4000)  # fmt: skip
    return Profile(**{**base, **kw})


def test_ring_tree_and_butterfly_latencies_at_p():
    # no backward to overlap with: compute (10 s x 2/p at a fixed global batch) + collective
    assert predict_step(dp(algorithm="ring"), 4, LATENCY_ONLY) == pytest.approx(5 + 2 * 3)
    assert predict_step(dp(algorithm="tree"), 8, LATENCY_ONLY) == pytest.approx(2.5 + 2 * 3)
    assert predict_step(dp(algorithm="butterfly"), 8, LATENCY_ONLY) == pytest.approx(2.5 + 3)
    weak = predict_step(dp(algorithm="ring"), 4, LATENCY_ONLY, weak=True)
    assert weak == pytest.approx(10 + 6)  # each device keeps its batch


def test_buckets_overlap_backward():
    prof = dp(backward_s=6.0, buckets=3, algorithm="all_to_all")
    # forward 4, then 3 backward slices of 2 s; each bucket's allreduce (1 s at alpha = 1)
    # starts when its slice ends: the last one ends 1 s after backward
    assert predict_step(prof, 2, LATENCY_ONLY) == pytest.approx(11.0)
    assert predict_step(prof, 2, LATENCY_ONLY, speed=2.0) == pytest.approx(6.0)


def test_parameter_server_link_is_shared_by_the_workers():
    prof = dp("ps", servers=1, processes=3, compute_s=0.0, grad_bytes=1000)
    # every worker pushes 1000 B then pulls 1000 B through the one server's port: p at once
    for p in (1, 2, 4):
        assert predict_step(prof, p, BANDWIDTH_ONLY) == pytest.approx(2 * p * 1.0)


def test_pipeline_follows_the_gpipe_schedule():
    prof = Profile("gpipe", "pipeline", 2, 2, 8, 0.0, compute_s=6.0, chunks=2, fwd_s=1.0,
                   bwd_s=2.0, act_bytes=0, max_devices=4, limit="4 layers")  # fmt: skip
    free = Topology(Link("free", 0.0, 0.0), Link("free", 0.0, 0.0))
    # K = 2 stages: per stage F = 0.5, B = 1; M = 2. Stage 1: F0 at 0.5, F1, B1, B0 ...
    # critical path: F0 F1 on stage 0 (1), F1 on stage 1 (0.5), B1 B0 on stage 1 (2),
    # B0 on stage 0 (1) = 4.5; plus the non-fwd/bwd compute (6 - 2 * 3 / 2 = 3)
    assert predict_step(prof, 2, free) == pytest.approx(4.5 + 3.0)
    with pytest.raises(NotApplicable, match="8 stages > 4 layers"):
        predict_step(prof, 8, free)
    assert scaling_row(prof, 8, free)["note"] == "8 stages > 4 layers"


def test_tensor_parallel_splits_compute_and_pays_ring_allreduces():
    prof = Profile("tp", "tp", 2, 2, 8, 0.0, compute_s=6.0, collectives=3, collective_bytes=400)
    # compute 6 x 2/4 = 3; each allreduce: ring 2(p-1) = 6 latencies
    assert predict_step(prof, 4, LATENCY_ONLY) == pytest.approx(3 + 3 * 6)


def test_only_the_per_sample_part_of_compute_shrinks_with_the_batch():
    prof = dp(batch_s=6.0)  # 4 s per step whatever the batch
    assert predict_step(prof, 4, LATENCY_ONLY) == pytest.approx(4 + 6 * 2 / 4 + 2 * 3)


def test_efficiency_is_one_without_communication():
    free = Topology(Link("free", 0.0, 0.0), Link("free", 0.0, 0.0))
    row = scaling_row(dp(), 64, free)
    assert row["efficiency"] == pytest.approx(1.0)
    assert row["images_per_s"] == pytest.approx(4 * 64 / 10.0)  # 4 samples per device
