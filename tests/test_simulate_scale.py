"""Scale-out graphs on hand-made profiles: step times worked out by hand from the schedule."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from lightning_par.simulate.builders import NotApplicable
from lightning_par.simulate.links import Link, Topology
from lightning_par.simulate.profile import Profile
from lightning_par.simulate.report import MEMORY_NOTE, scaling_table
from lightning_par.simulate.scale import predict_step, scaling_row
from lightning_par.simulate.tp_share import busiest_share
from lightning_par.tensorparallel.cost import busiest_rank_share
from lightning_par.tensorparallel.plan import Plan, resolve_plan

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


def test_the_servers_turn_overlaps_the_workers_time_between_steps():
    free = Topology(Link("free", 0.0, 0.0), Link("free", 0.0, 0.0))
    # 4 s of each step is not forward/backward (optimiser, next batch): the server's update
    # (3 s) hides behind it; a 5 s update shows 1 s of it
    hidden = dp("ps", servers=1, processes=3, compute_s=10.0, batch_s=6.0, server_s=3.0)
    assert predict_step(hidden, 2, free) == pytest.approx(10.0)
    assert predict_step(replace(hidden, server_s=5.0), 2, free) == pytest.approx(11.0)
    # at 4 workers the per-sample 6 s halves, the 4 s between steps does not
    assert predict_step(hidden, 4, free) == pytest.approx(4.0 + 3.0)


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


def test_tensor_parallel_splits_only_what_the_plan_cuts_at_p():
    free = Topology(Link("free", 0.0, 0.0), Link("free", 0.0, 0.0))
    # 6 s of the measured 10 s is the model (forward, backward); 4 s is not split
    prof = Profile("tp", "tp", 2, 2, 8, 0.0, compute_s=10.0, model="CifarCNN", model_s=6.0,
                   max_devices=16, limit="")  # fmt: skip
    at_2 = busiest_share("CifarCNN", 2)
    for p in (3, 4):  # at 3 and 4 only the second block's pair splits (16 channels: 8 | 4 + 4)
        expected = 4.0 + 6.0 * busiest_share("CifarCNN", p) / at_2
        assert predict_step(prof, p, free) == pytest.approx(expected)
    assert predict_step(prof, 3, free) > predict_step(prof, 2, free)  # the first block whole
    with pytest.raises(NotApplicable, match="no layer the automatic plan cuts 8 ways"):
        predict_step(prof, 8, free)


def test_busiest_rank_share_weighs_each_cut_by_its_flops_and_largest_slice():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 6))
    x = torch.randn(5, 4)
    flops = [2 * 5 * 4 * 8, 2 * 5 * 8 * 6, 2 * 5 * 6 * 6]  # the pair 0 -> 2, then 4 whole
    for p in (2, 3):
        plan = resolve_plan(net, p, root="")
        sizes = [cut.sizes for cut in plan.cuts if cut.name == "0"][0]
        largest = max(sizes) / sum(sizes)
        expected = ((flops[0] + flops[1]) * largest + flops[2]) / sum(flops)
        assert busiest_rank_share(net, plan, x) == pytest.approx(expected)
    assert busiest_rank_share(net, Plan(1), x) == pytest.approx(1.0)


def test_only_the_per_sample_part_of_compute_shrinks_with_the_batch():
    prof = dp(batch_s=6.0)  # 4 s per step whatever the batch
    assert predict_step(prof, 4, LATENCY_ONLY) == pytest.approx(4 + 6 * 2 / 4 + 2 * 3)


def test_efficiency_is_one_without_communication():
    free = Topology(Link("free", 0.0, 0.0), Link("free", 0.0, 0.0))
    row = scaling_row(dp(), 64, free)
    assert row["efficiency"] == pytest.approx(1.0)
    assert row["images_per_s"] == pytest.approx(4 * 64 / 10.0)  # 4 samples per device


def test_the_measured_share_swaps_each_cut_layers_time_for_its_largest_slices(monkeypatch):
    """On this machine the validation weighs the model by times, not FLOPs: the model's time,
    less each cut layer's, plus the time of its largest slice (a fake clock here: the time is
    read from the layer's shape, so the arithmetic is checked, not the machine)."""
    from lightning_par.simulate import tp_share

    def fake_time(layer, x):
        if isinstance(layer, nn.Linear):
            return {(4, 8): 3.0, (4, 3): 2.5, (8, 6): 4.0, (3, 6): 1.0}[
                (layer.in_features, layer.out_features)
            ]
        return 20.0  # the whole network

    monkeypatch.setattr(tp_share, "_fwd_bwd_s", fake_time)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 6))
    plan = resolve_plan(net, 3, root="")  # 8 units cut 3 | 3 | 2: the largest slice is 3
    assert [max(c.sizes) for c in plan.cuts if c.style != "norm"] == [3, 3]
    share = tp_share.measured_busiest_share(net, plan, torch.randn(5, 4))
    assert share == pytest.approx((20.0 - (3.0 - 2.5) - (4.0 - 1.0)) / 20.0)
    assert tp_share.measured_busiest_share(net, Plan(1), torch.randn(5, 4)) == 1.0


def zero(stage: int, **kw) -> Profile:
    return dp("zero", options={"stage": stage}, **kw)


def test_zero_stages_pay_their_ring_phases_after_the_step_or_around_each_layer():
    # p = 4, alpha = 1: a ring phase (reduce-scatter or all-gather) is p - 1 = 3 latencies,
    # the allreduce 6; compute 10 x 2/4 = 5, no backward to hide behind
    assert predict_step(zero(1), 4, LATENCY_ONLY) == pytest.approx(5 + 6 + 3)
    assert predict_step(zero(2), 4, LATENCY_ONLY) == pytest.approx(5 + 3 + 3)
    # stage 3: gather, forward, gather, backward, reduce-scatter: three phases in the open
    assert predict_step(zero(3), 4, LATENCY_ONLY) == pytest.approx(5 + 3 * 3)


def test_zero_stage_3_prefetches_the_next_layer_while_this_one_computes():
    # p = 2: each phase 1 s. Two units; backward 6 s, forward half of it, 1 s of the rest.
    # rest 1, gather 1, forward 1.5 (the second gather behind it), forward 1.5, gather 1
    # (backward's first), backward 3 (the second gather and the first reduce-scatter
    # behind it), backward 3, the last reduce-scatter 1
    prof = zero(3, backward_s=6.0, buckets=2)
    assert predict_step(prof, 2, LATENCY_ONLY) == pytest.approx(1 + 1 + 3 + 1 + 6 + 1)


def test_zero_memory_per_rank_is_the_papers_figure_1():
    from lightning_par.simulate.memory import zero_state_bytes

    # Rajbhandari et al. 2020, figure 1: 7.5B parameters, 64 ranks, mixed-precision Adam
    # (2 bytes of fp16 parameters, 2 of gradients, K = 12 of optimizer state per parameter)
    psi = 7.5e9
    gigabytes = {s: zero_state_bytes(2 * psi, 12 * psi, s, 64)["total"] / 1e9 for s in (1, 2, 3)}
    assert gigabytes == pytest.approx({1: 31.4, 2: 16.6, 3: 1.9}, abs=0.05)
    assert zero_state_bytes(4, 8, 1, 1)["total"] == 16  # one rank: data parallelism's 16 Ψ
    free = Topology(Link("free", 0.0, 0.0), Link("free", 0.0, 0.0))
    # 400 bytes of fp32 parameters, SGD's momentum measured as 200 on each of 2 ranks
    row = scaling_row(zero(3, grad_bytes=400, optimizer_bytes=200), 8, free)
    assert row["state_bytes"] == pytest.approx((400 + 400 + 400) / 8)
    other = scaling_row(dp(), 8, free)
    assert other["state_bytes"] is None  # no model for the others
    assert MEMORY_NOTE in scaling_table([row, other]) and MEMORY_NOTE not in scaling_table([other])


def test_pipeline_stages_hold_the_layers_the_strategys_cut_gives_them():
    from lightning_par.measure.run import make_model
    from lightning_par.pipeline.partition import balance_by_params
    from lightning_par.simulate.builders import build
    from lightning_par.simulate.ops import Compute
    from lightning_par.simulate.stage_share import cut_bytes, layer_weights, stage_shares

    prof = Profile("gpipe", "pipeline", 2, 2, 8, 0.0, compute_s=6.0, chunks=2, fwd_s=1.0,
                   bwd_s=2.0, act_bytes=1, max_devices=4, limit="4 layers",
                   model="CifarCNN")  # fmt: skip
    balance = balance_by_params(make_model("CifarCNN").net, 4)
    shares = stage_shares("CifarCNN", balance)
    assert balance == [1, 1, 1, 1] and sum(shares) == pytest.approx(1.0)
    assert max(shares) > 0.4  # a residual block, not a quarter of the model
    graph = build(prof, 4, LATENCY_ONLY)
    for s, share in enumerate(shares):
        fwd_bwd = sum(op.seconds for op in graph.lanes[(s, "main")]
                      if isinstance(op, Compute) and op.name != "overhead")  # fmt: skip
        assert fwd_bwd == pytest.approx(2 * 3.0 * share)  # 2 micro-batches of 1 + 2 s
    # each cut sends the activation the model has there (a micro-batch of 8 / 2 images)
    sizes = sorted({m.nbytes for m in graph.messages})
    assert sizes == sorted(set(cut_bytes("CifarCNN", balance, 4)))
    # the measured run's stages, where the profile holds them, set each layer's weight:
    # the layers of its stage take its time in the ratio their timings give
    weights = layer_weights("CifarCNN")
    base = balance_by_params(make_model("CifarCNN").net, 2)
    measured = stage_shares("CifarCNN", balance, 0, (base, (1.0, 3.0)))
    first = weights[0] / (weights[0] + weights[1])
    assert measured[0] == pytest.approx(0.25 * first) and sum(measured) == pytest.approx(1.0)
    assert measured[2] + measured[3] == pytest.approx(0.75)
    # a user's own run (no compare model to cut): an even split, the measured activations
    even = build(replace(prof, model=""), 4, LATENCY_ONLY)
    assert {m.nbytes for m in even.messages} == {1}


def test_tensor_parallel_runs_the_allreduces_of_the_plan_at_p():
    from lightning_par.simulate.builders import build
    from lightning_par.simulate.ops import Comm
    from lightning_par.simulate.tp_share import tp_allreduces

    prof = Profile("tp", "tp", 2, 2, 48, 0.0, compute_s=10.0, model="CifarCNN", model_s=6.0,
                   collectives=3, collective_bytes=400, max_devices=16, limit="")  # fmt: skip
    # at 2 ranks both residual blocks are cut (4 allreduces a step), at 3 and 4 only the
    # second (2): the measured count does not carry over
    assert len(tp_allreduces(prof, 2)) == 4
    assert len(tp_allreduces(prof, 3)) == len(tp_allreduces(prof, 4)) == 2
    graph = build(prof, 3, LATENCY_ONLY)
    assert sum(isinstance(op, Comm) for op in graph.lanes[(0, "main")]) == 2
    # measured communication CPU, on this machine's cores, follows the bytes a rank sends
    cpu = replace(prof, comm_cpu_s=4.0)
    at_3 = [op for op in build(cpu, 3, LATENCY_ONLY, cores=2).lanes[(0, "main")]
            if isinstance(op, Comm) and op.on_cores]  # fmt: skip
    sent = {p: sum(2 * (p - 1) / p * b for b in tp_allreduces(prof, p)) for p in (2, 3)}
    assert sum(op.seconds for op in at_3) == pytest.approx(4.0 * sent[3] / sent[2])
    assert not any(op.on_cores for op in graph.lanes[(0, "main")] if isinstance(op, Comm))


def test_an_uneven_tensor_parallel_cut_asks_less_of_shared_cores_than_p_busiest_ranks():
    from lightning_par.simulate.builders import build
    from lightning_par.simulate.tp_share import mean_over_busiest

    # even cuts at 2 and 4 ranks; at 3 the second block splits 16 | 8 | 8 channels
    assert mean_over_busiest("CifarCNN", 2) == pytest.approx(1.0)
    assert mean_over_busiest("CifarCNN", 4) == pytest.approx(1.0)
    uneven = mean_over_busiest("CifarCNN", 3)
    assert 0.8 < uneven < 1.0
    prof = Profile("tp", "tp", 2, 2, 8, 0.0, compute_s=10.0, model="CifarCNN", model_s=6.0,
                   max_devices=16, limit="")  # fmt: skip
    model = 6.0 * busiest_share("CifarCNN", 3) / busiest_share("CifarCNN", 2)
    work = 4.0 + model
    # the lane stands for 3 ranks: the busiest one's work on the critical path, their sum
    # on the cores (the two lighter ranks spare part of the model)
    assert build(prof, 3, LATENCY_ONLY).weight[0] == pytest.approx(
        3 * (work - model * (1 - uneven)) / work
    )
    assert build(prof, 4, LATENCY_ONLY).weight[0] == pytest.approx(4.0)
