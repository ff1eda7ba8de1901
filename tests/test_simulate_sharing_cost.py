"""A rank's step at each size on this machine (:mod:`lightning_par.simulate.sharing_cost`):
the model's step timed on each size's batch, what taking turns on the cores adds, and where
the scale-out uses them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_par.simulate import sharing_cost
from lightning_par.simulate.links import Link, Topology
from lightning_par.simulate.machine import Machine
from lightning_par.simulate.ops import Msg, Post, Wait
from lightning_par.simulate.profile import Profile
from lightning_par.simulate.sharing_cost import measure_step_cpu
from lightning_par.simulate.validate import scaled

LATENCY_ONLY = Topology(Link("a", alpha=1.0, beta=0.0), Link("a", alpha=1.0, beta=0.0))
#: CifarCNN's step on a core of its own at 24, 16 and 12 images (here, one thread)
ALONE = {24: 0.0295, 16: 0.0191, 12: 0.0155}


def fake_ranks(crowded_cpu: list[dict[int, float]], other: list[float]):
    """A ``run_on_ranks``: a rank a core each takes :data:`ALONE`; ``world`` ranks taking
    turns take ``crowded_cpu[trial][batch]``; each trial ran beside ``other[trial]`` cores'
    worth of other load."""
    calls = []

    def run_on_ranks(fn, world, model, batches, steps, threads, timeout):
        calls.append((world, tuple(batches)))
        trial = sum(1 for w, _ in calls if w == 2) - 1
        cpu = [ALONE[b] for b in batches] if world == 2 else [crowded_cpu[trial][batches[0]]]
        ranks = [{"step_cpu": cpu, "cpu": 1.0, "wall": 1.0, "busy": None}] * world
        ranks[0] = {**ranks[0], "busy": world + (other[trial] if world == 2 else 0.0)}
        return ranks

    return calls, run_on_ranks


def test_each_sizes_step_is_timed_alone_and_taking_turns(monkeypatch):
    crowded = [{16: 0.0215, 12: 0.0150}, {16: 0.0225, 12: 0.0152}]
    calls, fake = fake_ranks(crowded, [0.0, 0.0])
    monkeypatch.setattr(sharing_cost, "run_on_ranks", fake)
    alone, cost = measure_step_cpu("CifarCNN", 48, (2, 3, 4), cores=2, trials=2)
    assert alone == pytest.approx({2: 0.0295, 3: 0.0191, 4: 0.0155})
    # 2 ranks have a core each: nothing to pay; a cost below 1 is noise, not a gain
    assert cost == pytest.approx({3: 0.022 / 0.0191, 4: 1.0})
    assert calls == [(2, (24, 16, 12)), (3, (16,)), (4, (12,))] * 2


def test_a_trial_beside_other_load_is_run_again(monkeypatch):
    crowded = [{16: 0.030}, {16: 0.021}, {16: 0.022}]
    calls, fake = fake_ranks(crowded, [1.0, 0.0, 0.1])
    monkeypatch.setattr(sharing_cost, "run_on_ranks", fake)
    alone, cost = measure_step_cpu("CifarCNN", 48, (2, 3), cores=2, trials=2)
    assert cost == pytest.approx({3: 0.0215 / 0.0191})
    assert len(calls) == 6
    # never quiet: not measured (beside a busy core the cost read 1.40 at 4 ranks)
    calls, fake = fake_ranks([{16: 0.030}, {16: 0.025}], [1.0, 0.5])
    monkeypatch.setattr(sharing_cost, "run_on_ranks", fake)
    assert measure_step_cpu("CifarCNN", 48, (3,), cores=2, trials=1) == ({}, {})


def test_the_model_step_is_measured_with_real_ranks():
    alone, cost = measure_step_cpu("CifarCNN", 48, (2, 3), cores=2, steps=4, trials=1)
    if not alone:  # both tries ran beside other processes' load: not measured, as documented
        assert cost == {}
        return
    assert set(alone) == {2, 3} and alone[2] > alone[3] > 0
    assert set(cost) == {3} and 1.0 <= cost[3] < 3.0


def test_a_ranks_per_sample_work_follows_the_models_step_timed_on_both_batches():
    from lightning_par.simulate.scale import on_this_machine
    from lightning_par.simulate.step_costs import batch_share

    alone = {2: 0.0295, 3: 0.0191, 4: 0.0155}
    # 35 ms at 2 ranks, 29 ms of it per sample: 6 ms of framework stays
    prof = Profile("x", "allreduce", 2, 2, 48, 0.04, compute_s=0.035, batch_s=0.029,
                   cpu_based=True)  # fmt: skip
    for p in (3, 4):
        timed = on_this_machine(prof, p, alone)
        at_p = 0.035 * batch_share(timed, p, weak=False)
        assert at_p == pytest.approx(0.006 + 0.029 * alone[p] / alone[2])
    # not timed, or not data parallel: in proportion to the batch
    assert 0.035 * batch_share(on_this_machine(prof, 8, alone), 8, False) == pytest.approx(
        0.006 + 0.029 / 4
    )
    assert on_this_machine(replace(prof, family="tp"), 4, alone).sample_scale == {}


def test_data_parallel_ranks_pay_the_timed_batch_and_the_cost_of_taking_turns():
    machine = Machine(2, 1, {4: 1.5}, {2: 8.0, 4: 3.0})
    dp = Profile("x", "allreduce", 2, 2, 8, 10.0, compute_s=10.0, batch_s=10.0,
                 cpu_based=True)  # fmt: skip
    # 4 ranks: the 10 s per sample times 3 / 8 (the model's step timed on both batches), 1.5
    # times that for taking turns, 4 ranks on 2 cores
    guess, split, offset = scaled(dp, 4, LATENCY_ONLY, machine=machine)
    assert guess - offset == pytest.approx(2 * 10 * 3 / 8 * 1.5 + 6)
    # a model whose step at 4 ranks' batch is 5 s, not half of 8: 10 x 5 / 8 s each
    timed = Machine(2, 1, {}, {2: 8.0, 4: 5.0})
    assert scaled(dp, 4, LATENCY_ONLY, machine=timed)[0] - offset == pytest.approx(
        2 * 10 * 5 / 8 + 6
    )
    untimed = Machine(2, 1, {}, {})  # older runs: the per-sample part as profiled
    assert scaled(dp, 4, LATENCY_ONLY, machine=untimed)[0] - offset == pytest.approx(2 * 5 + 6)


def test_a_span_pays_the_cost_of_turns_as_far_as_it_shares_the_cores():
    from lightning_par.simulate.cores import turn_factor
    from lightning_par.simulate.engine import simulate
    from lightning_par.simulate.ops import Compute, Graph

    # measured for 4 ranks on 2 cores (sharing 2 times over): 1.2 times the CPU
    assert turn_factor(2.0, (1.2, 2.0)) == pytest.approx(1.2)
    assert turn_factor(1.5, (1.2, 2.0)) == pytest.approx(1.1)  # half as much sharing
    assert turn_factor(3.0, (1.2, 2.0)) == pytest.approx(1.2)  # never more than measured
    assert turn_factor(1.0, (1.2, 2.0)) == 1.0 and turn_factor(2.0, None) == 1.0
    # two lanes of 1 s at once on one core: 2 x 1.2 s each; one after the other: no turns
    together = Graph()
    for rank in range(2):
        together.lane(rank).append(Compute(1.0))
    free = Topology(Link("free", 0.0, 0.0), Link("free", 0.0, 0.0))
    result = simulate(together, free, cores=1, turn_cost=(1.2, 2.0))
    assert result.max_step_s == pytest.approx(2.4)
    assert result.per_step_core_wait(0)["compute"] == pytest.approx(1.2)
    apart = Graph()
    m = apart.message(Msg(0, 1, 0))
    apart.lane(0).extend([Compute(1.0), Post(m), Wait(m)])
    apart.lane(1).extend([Post(m), Wait(m), Compute(1.0)])
    assert simulate(apart, free, cores=1, turn_cost=(1.2, 2.0)).max_step_s == pytest.approx(2.0)


def test_tensor_parallel_ranks_pay_no_cost_of_taking_turns():
    # the cost is timed on the data-parallel step; tensor-parallel ranks showed none of it
    tp = Profile("t", "tp", 2, 2, 8, 10.0, compute_s=4.0, batch_s=4.0, collectives=1,
                 collective_bytes=40, cpu_based=True)  # fmt: skip
    costly = Machine(2, 1, {3: 1.5, 4: 1.5}, {})
    free = Machine(2, 1, {}, {})
    for p in (3, 4):
        assert scaled(tp, p, LATENCY_ONLY, machine=costly)[0] == pytest.approx(
            scaled(tp, p, LATENCY_ONLY, machine=free)[0]
        )
    dp = Profile("x", "allreduce", 2, 2, 8, 10.0, compute_s=10.0, batch_s=10.0, cpu_based=True)
    assert scaled(dp, 4, LATENCY_ONLY, machine=costly)[0] > scaled(dp, 4, LATENCY_ONLY,
                                                                   machine=free)[0]  # fmt: skip
