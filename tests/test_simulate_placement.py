"""Ranks placed whole on cores: the slowest replica's wait, the scheduler's delay, by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_par.simulate.builders import build
from lightning_par.simulate.cores import placement_wait
from lightning_par.simulate.links import Link, Topology
from lightning_par.simulate.profile import Profile
from lightning_par.simulate.scale import late_replicas, predict_split, predict_step
from lightning_par.simulate.scheduler import delay_from_excess, delay_from_laps

LATENCY_ONLY = Topology(Link("a", alpha=1.0, beta=0.0), Link("a", alpha=1.0, beta=0.0))


def test_even_placements_lose_nothing():
    assert placement_wait(1.0, 4, 2, delay_s=0.5) == 0.0  # two to a core
    assert placement_wait(1.0, 2, 2, delay_s=0.5) == 0.0  # a core each
    assert placement_wait(1.0, 3, 4, delay_s=0.5) == 0.0  # fewer ranks than cores
    assert placement_wait(1.0, 3, 2, threads=2, delay_s=0.5) == 0.0  # 6 threads, 3 a core
    assert placement_wait(1.0, 3, 2, delay_s=0.0) == 0.0  # a scheduler that moves at once


def test_three_ranks_on_two_cores_wait_half_the_delay():
    # the lone rank ends at 1 s; the pair has 0.5 s each left, runs on at half speed for
    # the delay, then a core each: 1 + d + (0.5 - d / 2) = 1.5 + d / 2
    assert placement_wait(1.0, 3, 2, delay_s=0.2) == pytest.approx(0.1)
    # a delay past the work: the pair never moves and ends at 2 s, fair sharing at 1.5 s
    assert placement_wait(1.0, 3, 2, delay_s=5.0) == pytest.approx(0.5)
    # 5 on 4 cores: the pair ends at 1 + 0.2 + 0.4 = 1.6 s, fair sharing at 1.25 s
    assert placement_wait(1.0, 5, 4, delay_s=0.2) == pytest.approx(0.35)
    # 5 on 2: one core holds three, each with 1/3 s left at 2 s; 0.2 s at a third of a core,
    # then three threads on two cores: 2 + 0.2 + (1/3 - 0.2/3) * 1.5 = 2.6 s, fair 2.5 s
    assert placement_wait(1.0, 5, 2, delay_s=0.2) == pytest.approx(0.1)


@pytest.mark.parametrize("cores", [2, 4, 16])
def test_the_delay_is_read_back_from_the_excess_it_causes(cores):
    for delay in (0.001, 0.004, 0.009):
        excess = placement_wait(0.02, cores + 1, cores, delay_s=delay)
        assert delay_from_excess(excess, 0.02, cores) == pytest.approx(delay, rel=1e-6)
    assert delay_from_excess(-0.001, 0.02, cores) == 0.0  # faster than fair: no delay
    # past where a freed core is never taken in time: the bound, not an endless search
    assert delay_from_excess(1.0, 0.02, cores) == pytest.approx(2 * 0.02 * (cores + 1))


def test_the_delay_is_read_off_the_laps_of_ranks_that_train_and_meet():
    # 3 ranks of 20 ms of CPU a step on 2 cores, 1 ms to meet: fair sharing 30 + 1 ms; a
    # 4 ms delay costs the pair d / 2 more
    lap = 1.5 * 0.02 + 0.004 / 2 + 0.001
    assert delay_from_laps(lap, 0.02, 0.001, 3, 2) == pytest.approx(0.004, rel=1e-6)
    assert delay_from_laps(1.5 * 0.02 + 0.001, 0.02, 0.001, 3, 2) == 0.0  # fair: no delay
    # placed evenly (4 on 2, 2 on 2, 3 on 4): nothing waits, nothing to read
    assert delay_from_laps(0.05, 0.02, 0.001, 4, 2) is None
    assert delay_from_laps(0.05, 0.02, 0.001, 2, 2) is None
    assert delay_from_laps(0.05, 0.02, 0.001, 3, 4) is None
    # 5 ranks on 4 cores
    lap5 = 1.25 * 0.02 + placement_wait(0.02, 5, 4, delay_s=0.003) + 0.001
    assert delay_from_laps(lap5, 0.02, 0.001, 5, 4) == pytest.approx(0.003, rel=1e-6)


def data_parallel(backward_s: float = 0.0) -> Profile:
    return Profile("x", "allreduce", 2, 2, 8, 0.0, compute_s=10.0, batch_s=10.0,
                   backward_s=backward_s, grad_bytes=4000, buckets=2)  # fmt: skip


def test_replicas_wait_for_the_slowest_where_they_cannot_be_placed_evenly():
    prof = data_parallel()
    fair = predict_step(prof, 3, LATENCY_ONLY, cores=2)
    # 3 ranks of 10 * 2/3 s each on 2 cores: 10 s fair, and half the 2 s delay more
    assert fair == pytest.approx(10 + 4)  # the ring's 2(p-1) latencies
    late, split = predict_split(prof, 3, LATENCY_ONLY, cores=2, delay_s=2.0)
    assert late == pytest.approx(10 + 1 + 4)
    assert split["compute"] == pytest.approx(10.0)
    # 4 ranks, two to a core, and a machine of its own per rank: nothing to wait for
    assert predict_step(prof, 4, LATENCY_ONLY, cores=2, delay_s=2.0) == pytest.approx(
        predict_step(prof, 4, LATENCY_ONLY, cores=2)
    )
    assert predict_step(prof, 3, LATENCY_ONLY, delay_s=2.0) == pytest.approx(
        predict_step(prof, 3, LATENCY_ONLY)
    )


def test_other_work_fills_the_core_a_lone_replica_leaves_idle():
    prof = data_parallel()
    quiet = predict_step(prof, 3, LATENCY_ONLY, cores=2, delay_s=2.0)
    assert quiet - predict_step(prof, 3, LATENCY_ONLY, cores=2) == pytest.approx(1.0)
    # beside half a core's worth of other work, half of the 1 s wait is lost (and the
    # ranks share the 1.5 cores left)
    busy = predict_step(prof, 3, LATENCY_ONLY, cores=2, delay_s=2.0, other_load=0.5)
    fair = predict_step(prof, 3, LATENCY_ONLY, cores=2, other_load=0.5)
    assert busy - fair == pytest.approx(0.5)
    assert fair == pytest.approx(20 / 1.5 + 4)


def test_every_bucket_waits_for_the_slowest_replica():
    # backward in two buckets: each bucket starts as late as the slowest replica fills it
    graph = build(data_parallel(backward_s=6.0), 3, LATENCY_ONLY, cores=2)
    wait = late_replicas(graph, 3, 2, 1, delay_s=2.0)
    assert wait == pytest.approx(1.0)
    delays = [op.delay_s for op in graph.lanes[(0, "bg")] if hasattr(op, "delay_s")]
    assert delays == [1.0, 1.0]
    # a graph without an allreduce lane (tensor parallel, servers) is left alone
    tp = Profile("t", "tp", 2, 2, 8, 0.0, compute_s=4.0, batch_s=4.0, collectives=1,
                 collective_bytes=40)  # fmt: skip
    tp_graph = build(tp, 3, LATENCY_ONLY, cores=2)
    before = {lane: list(ops) for lane, ops in tp_graph.lanes.items()}
    assert late_replicas(tp_graph, 3, 2, 1, delay_s=2.0) == 0.0
    assert tp_graph.lanes == before


def test_the_validation_records_the_machine_it_measured(monkeypatch, tmp_path):
    import json

    from lightning_par.simulate import machine
    from lightning_par.simulate.sharing_cost import Steps

    asked = []

    def timed(model, batch, sizes, cores, threads):
        asked.append((model, batch, sizes, cores, threads))
        return Steps({2: 0.03, 3: 0.02, 4: 0.015}, {3: 1.1, 4: 1.05}, 0.005)

    monkeypatch.setattr(machine, "measure_step_cpu", timed)
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 2)
    found = machine.measure_machine((2, 3, 4), "CifarCNN", 48)
    assert asked == [("CifarCNN", 48, (2, 3, 4), 2, 1)]
    assert found == (2, 1, 0.005, {3: 1.1, 4: 1.05}, {2: 0.03, 3: 0.02, 4: 0.015}, ())
    # --reuse reads what the runs recorded, not this machine
    folder = tmp_path / "0-p2-ring_allreduce"
    folder.mkdir()
    (folder / "row.json").write_text(json.dumps(found.as_row()))
    assert machine.kept_machine({("ring_allreduce", 2): [folder]}) == found
    assert len(asked) == 1
    # every trial beside other processes' load: not measured, and it says so
    monkeypatch.setattr(machine, "measure_step_cpu", lambda *args: Steps({}, {}, None))
    busy = machine.measure_machine((2, 3, 4), "CifarCNN", 48)
    assert busy.delay_s == 0.0 and busy.sharing_cost == {} and busy.step_cpu == {}
    assert busy.unmeasured == ("scheduler delay, step CPU at each size, cost of turns",)


def test_what_the_model_leaves_out_of_the_small_step_is_carried_once_per_step():
    from lightning_par.simulate.validate import scaled

    prof = replace(data_parallel(), step_s=15.0)
    # the model's 2-rank step: 10 s of compute and the ring's 2 latencies; measured 3 s more
    guess, split, offset = scaled(prof, 4, LATENCY_ONLY)
    assert offset == pytest.approx(3.0)
    # at 4 ranks: 5 s of compute, 6 latencies, and the same 3 s (not three times 3 s, as a
    # latency fitted to the 2-rank step would give)
    assert guess == pytest.approx(5 + 6 + 3)
    assert split["compute"] == pytest.approx(5.0)
