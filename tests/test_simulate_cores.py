"""Ranks that share a machine's cores (processor sharing), worked out by hand."""

from __future__ import annotations

import pytest

from lightning_par.simulate.cores import (
    balanced_placements,
    capacity,
    lightning_threads,
    place,
    stretches,
)
from lightning_par.simulate.engine import simulate
from lightning_par.simulate.links import Link, Topology
from lightning_par.simulate.ops import Comm, Compute, Graph, Msg, Post, Wait
from lightning_par.simulate.profile import Profile
from lightning_par.simulate.scale import predict_split, predict_step

FREE = Topology(Link("free", 0.0, 0.0), Link("free", 0.0, 0.0))
LATENCY_ONLY = Topology(Link("a", alpha=1.0, beta=0.0), Link("a", alpha=1.0, beta=0.0))


def lanes(n: int, seconds: float = 1.0) -> Graph:
    g = Graph()
    for r in range(n):
        g.lane(r).append(Compute(seconds))
    return g


def test_ranks_computing_at_once_share_the_cores():
    assert simulate(lanes(3), FREE, cores=3).max_step_s == pytest.approx(1.0)
    assert simulate(lanes(3), FREE, cores=2).max_step_s == pytest.approx(1.5)
    assert simulate(lanes(4), FREE, cores=2).max_step_s == pytest.approx(2.0)
    # one lane standing for four ranks counts four times; two threads each count twice
    one = Graph(weight={0: 4})
    one.lane(0).append(Compute(1.0))
    assert simulate(one, FREE, cores=2).max_step_s == pytest.approx(2.0)
    assert simulate(lanes(2), FREE, cores=2, threads=2).max_step_s == pytest.approx(2.0)


def test_a_rank_blocked_in_a_receive_takes_no_core():
    g = Graph()
    m = g.message(Msg(0, 1, 0))
    g.lane(0).extend([Compute(1.0), Post(m), Wait(m)])
    g.lane(1).extend([Post(m), Wait(m), Compute(1.0)])
    # rank 1 sleeps while rank 0 computes: one core is enough, nothing is stretched
    assert simulate(g, FREE, cores=1).max_step_s == pytest.approx(2.0)


def test_stretch_is_the_time_averaged_threads_over_cores():
    lane0, lane1 = (0, "main"), (1, "main")
    out = stretches({(lane0, 0): (0.0, 2.0, 2.0), (lane1, 0): (1.0, 2.0, 1.0)}, {}, cores=1)
    assert out[(lane0, 0)] == pytest.approx(1.5) and out[(lane1, 0)] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="cores must be >= 1"):
        stretches({}, {}, cores=0)


def test_ranks_of_unequal_work_are_placed_whole_the_busiest_first():
    # the pipeline's four stages on two cores: each heavy stage beside a light one
    work = {0: 17.0, 1: 46.0, 2: 44.0, 3: 10.0}
    assert place(work, cores=2) == {1: 0, 2: 1, 0: 1, 3: 0}
    # a run lands on either heavy stage beside either light one; never the two heavy
    # stages on one core; the better balanced way round weighs more
    ways = balanced_placements(work, cores=2)
    assert sum(w for w, _ in ways) == pytest.approx(1.0)
    pairs = {frozenset(r for r, c in at.items() if c == at[1]): w for w, at in ways}
    assert set(pairs) == {frozenset({1, 0}), frozenset({1, 3})}
    assert pairs[frozenset({1, 3})] > pairs[frozenset({1, 0})] > 0.3
    # a stage's timing moved by a few per cent moves the weights a little, not to 0
    nudged = dict(balanced_placements({**work, 0: 19.0}, cores=2))
    assert min(nudged) > 0.3
    lane0, lane1 = (0, "main"), (1, "main")
    spans = {(lane0, 0): (0.0, 2.0, 2.0), (lane1, 0): (0.0, 2.0, 2.0)}
    # two ranks on one core take turns; on two cores neither waits, though both run at once
    apart = stretches(spans, {}, cores=2, placed={0: 0, 1: 1})
    together = stretches(spans, {}, cores=2, placed={0: 0, 1: 0})
    assert apart[(lane0, 0)] == pytest.approx(1.0) and together[(lane0, 0)] == pytest.approx(2.0)


def test_stages_placed_whole_take_turns_on_their_core_alone():
    # three stages at once on two cores (3, 2, 2 s): placed whole, the busiest has a core
    # to itself and the two others take turns on the second, ending at 4 s; shared evenly
    # over both cores (the data-parallel rule) all would end by 3.5 s
    g = Graph(placed=True)
    for r, seconds in enumerate((3.0, 2.0, 2.0)):
        g.lane(r).append(Compute(seconds))
    assert simulate(g, FREE, cores=2).max_step_s == pytest.approx(4.0)
    # beside other processes' load the balancer moves them among its tasks: even sharing
    busy = simulate(g, FREE, cores=2, other_load=0.5).max_step_s
    g.placed = False
    assert simulate(g, FREE, cores=2).max_step_s < 4.0
    assert busy == pytest.approx(simulate(g, FREE, cores=2, other_load=0.5).max_step_s)


def test_lightning_gives_each_rank_its_share_of_the_cores():
    assert [lightning_threads(p, 2) for p in (1, 2, 3, 4)] == [2, 1, 1, 1]
    assert lightning_threads(4, 16) == 4


def test_threads_the_ranks_were_given_override_lightnings_choice():
    from lightning_par.simulate.machine import measured_threads

    prof = Profile("x", "allreduce", 2, 2, 8, 0.0, compute_s=16.0, batch_s=16.0,
                   grad_bytes=4000)  # fmt: skip
    # 16 cores, 4 ranks: Lightning would give 4 threads each (16 at once: nothing shared);
    # ranks that kept the first (2-rank) launch's 8 threads put 32 on 16 cores: 2x
    assert predict_step(prof, 4, LATENCY_ONLY, cores=16) == pytest.approx(8 + 6)
    assert predict_step(prof, 4, LATENCY_ONLY, cores=16, threads=8) == pytest.approx(16 + 6)
    assert predict_step(prof, 4, LATENCY_ONLY, cores=16, threads=1) == pytest.approx(8 + 6)
    # the validation's rows: OMP_NUM_THREADS where set, else the 2-rank launch's choice
    assert measured_threads(16, env={}) == 8
    assert measured_threads(2, env={}) == 1
    assert measured_threads(16, env={"OMP_NUM_THREADS": "1"}) == 1
    assert measured_threads(16, env={"OMP_NUM_THREADS": "junk"}) == 8
    # --reuse on another machine or shell: the cores and threads the runs recorded
    from lightning_par.simulate.machine import recorded_machine
    from lightning_par.simulate.replay import Run

    runs = [Run("ring", [], None, row={"cores": 16, "threads": 1, "sharing_cost": {"3": 1.1}})]
    assert recorded_machine(runs) == (16, 1, {3: 1.1}, {}, ())
    assert recorded_machine(runs, cores=2, threads=2) == (2, 2, {3: 1.1}, {}, ())
    # runs that recorded nothing, from a machine with other cores: nothing measured here
    old = [Run("old", [], None)]
    assert recorded_machine(old, cores=999) == (999, measured_threads(999), {}, {}, ())


def test_scale_out_on_two_cores_slows_data_parallel_compute_by_p_over_cores():
    prof = Profile("x", "allreduce", 2, 2, 8, 0.0, compute_s=10.0, batch_s=10.0,
                   grad_bytes=4000)  # fmt: skip
    # at 4 ranks each computes 10 x 2/4 = 5 s of work; 4 ranks on 2 cores take 2x: 10 s;
    # the ring adds 2(p-1) = 6 latencies; the measured 2 ranks had a core each
    assert predict_step(prof, 4, LATENCY_ONLY, cores=2) == pytest.approx(10 + 6)
    assert predict_step(prof, 4, LATENCY_ONLY) == pytest.approx(5 + 6)
    step, split = predict_split(prof, 4, LATENCY_ONLY, cores=2)
    # half of the compute is the wait for a core
    assert split == pytest.approx({"compute": 10.0, "communication": 6.0, "waiting": 0.0,
                                   "core_compute": 5.0, "core_communication": 0.0})  # fmt: skip
    # measured at 4 ranks on 2 cores: its compute already held the 2x, removed first
    measured_at_4 = Profile("x", "allreduce", 4, 4, 8, 0.0, compute_s=10.0, batch_s=10.0)
    assert predict_step(measured_at_4, 4, LATENCY_ONLY, cores=2) == pytest.approx(10 + 6)


def test_idle_parameter_servers_take_no_core():
    prof = Profile("ps", "ps", 2, 3, 8, 0.0, compute_s=2.0, batch_s=2.0, servers=1,
                   grad_bytes=0)  # fmt: skip
    # two workers on two cores compute 2 s each; the server only waits for them
    assert predict_step(prof, 2, FREE, cores=2) == pytest.approx(2.0)
    # three workers: 2 x 2/3 s of work each, three at once on two cores
    assert predict_step(prof, 3, FREE, cores=2) == pytest.approx(2.0 * 2 / 3 * 1.5)


def test_other_processes_leave_the_ranks_fewer_cores():
    # two ranks of 1 s on 2 cores: 1 s alone, 2 s beside one core's worth of other work
    assert simulate(lanes(2), FREE, cores=2).max_step_s == pytest.approx(1.0)
    assert simulate(lanes(2), FREE, cores=2, other_load=1.0).max_step_s == pytest.approx(2.0)
    # one rank still has a core of its own beside one other core's worth
    assert simulate(lanes(1), FREE, cores=2, other_load=1.0).max_step_s == pytest.approx(1.0)
    assert capacity(2, 0.5) == pytest.approx(1.5)
    assert capacity(2, 5.0) == pytest.approx(0.1)  # a rank that ran at all got some


def test_loopback_messages_are_cpu_work_that_waits_for_a_core():
    # four ranks in one lane move their bytes at once: on 2 cores each waits as long again
    g = Graph(weight={0: 4})
    g.lane(0).extend([Compute(1.0), Comm(0.5, "bytes", on_cores=True), Comm(0.25, "latency")])
    result = simulate(g, FREE, cores=2)
    assert result.max_step_s == pytest.approx(2.0 + 1.0 + 0.25)
    assert result.per_step_core_wait(0) == pytest.approx({"compute": 1.0, "communication": 0.5})
    assert result.split[0]["communication"] == pytest.approx(1.25)
    # a machine of its own per rank: nothing waits
    alone = simulate(g, FREE)
    assert alone.max_step_s == pytest.approx(1.75)
    assert alone.per_step_core_wait(0) == {"compute": 0.0, "communication": 0.0}


def test_a_cpu_profile_is_not_divided_by_the_measured_runs_sharing():
    # measured at 4 ranks on 2 cores: wall compute held the 2x, CPU time does not
    cpu = Profile("x", "allreduce", 4, 4, 8, 0.0, compute_s=5.0, batch_s=5.0, cpu_based=True)
    assert predict_step(cpu, 4, LATENCY_ONLY, cores=2) == pytest.approx(10 + 6)
    # the same beside one core's worth of other work: 4 ranks on the core left
    assert predict_step(cpu, 4, LATENCY_ONLY, cores=2, other_load=1.0) == pytest.approx(20 + 6)
    step, split = predict_split(cpu, 4, LATENCY_ONLY, cores=2)
    assert split["core_compute"] == pytest.approx(5.0)
    assert split["core_communication"] == 0.0


def test_the_allreduce_family_pays_its_measured_communication_cpu_on_shared_cores():
    prof = Profile("x", "allreduce", 2, 2, 8, 0.0, compute_s=10.0, batch_s=10.0,
                   grad_bytes=4000, comm_cpu_s=1.0, cpu_based=True)  # fmt: skip
    # 4 ranks on 2 cores: 5 s of compute each, doubled; the ring's 6 latencies; each rank's
    # 1 s of message CPU, doubled too
    assert predict_step(prof, 4, LATENCY_ONLY, cores=2) == pytest.approx(10 + 6 + 2)
    # on other hardware (no cores to share) the link's cost says it all
    assert predict_step(prof, 4, LATENCY_ONLY) == pytest.approx(5 + 6)


def test_the_steps_own_overhead_pays_no_cost_of_taking_turns():
    # four ranks on two cores, a cost of 1.2 where they share them twice over: the model's
    # work pays it, the loop's per-step overhead (timed apart from it) does not
    def four(turns: bool) -> Graph:
        g = Graph()
        for r in range(4):
            g.lane(r).append(Compute(1.0, turns=turns))
        return g

    model = simulate(four(True), FREE, cores=2, turn_cost=(1.2, 2.0)).max_step_s
    overhead = simulate(four(False), FREE, cores=2, turn_cost=(1.2, 2.0)).max_step_s
    assert model == pytest.approx(2.4) and overhead == pytest.approx(2.0)
    # the data-parallel graph draws the per-step part apart where ranks share cores
    from lightning_par.simulate.builders import build

    prof = Profile("ring_allreduce", "allreduce", 2, 2, 8, 0.0, compute_s=0.03,
                   backward_s=0.01, batch_s=0.02, grad_bytes=4, cpu_based=True)  # fmt: skip
    ops = build(prof, 4, FREE, cores=2).lanes[(0, "main")]
    assert [op.turns for op in ops if isinstance(op, Compute)][0] is False
    assert ops[0].seconds == pytest.approx(0.01)
