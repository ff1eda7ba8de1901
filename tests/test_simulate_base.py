"""What a scale-out starts from (:mod:`lightning_par.simulate.base`) on hand-made runs: CPU
time for compute, each span at its best round, messages at their fastest, the other load."""

from __future__ import annotations

import time

import pytest

from lightning_par.comm.trace import CommTrace, Event, Message
from lightning_par.measure.probe import other_load, step_clock
from lightning_par.simulate.base import (
    base_profile,
    cpu_profile,
    cpu_ratio,
    fastest_link,
    spread,
)
from lightning_par.simulate.links import PRESETS, fit_link
from lightning_par.simulate.replay import Run

STEP = 10.0  # wall seconds per step
STEPS = 3
ROW = {"strategy": "ring_allreduce", "devices": 2, "global_batch": 8}


def probe(cpu: float, process: float, busy: float | None, step: float = STEP) -> dict:
    """A rank's probe over STEPS steps of ``step`` wall seconds: ``cpu`` main-thread and
    ``process`` CPU seconds per step, the machine ``busy`` seconds per step."""
    starts = [k * step for k in range(STEPS)]
    ends = [s + step for s in starts]

    def clock(per_step: float | None) -> dict:
        if per_step is None:
            return {"starts": [None] * STEPS, "ends": [None] * STEPS}
        # readings at each step's start and end (the last step's end closes it)
        return {"starts": [k * per_step for k in range(STEPS)],
                "ends": [(k + 1) * per_step for k in range(STEPS)]}  # fmt: skip

    record = {"starts": starts, "ends": ends, "losses": [0.0] * STEPS}
    for name, value in (("cpu", cpu), ("process_cpu", process), ("machine_busy", busy)):
        readings = clock(value)
        record[f"{name}_starts"], record[f"{name}_ends"] = readings["starts"], readings["ends"]
    return record


def ring_run(cpu: float = 5.0, backward_cpu: float | None = 2.0, backward_wall: float = 4.0,
             process: float = 6.0, other: float = 1.0, step: float = STEP) -> Run:  # fmt: skip
    """Two ranks that only compute (their steps are all compute: no messages), each with a
    backward span of ``backward_wall`` seconds (``backward_cpu`` of CPU) per step of
    ``step`` seconds, beside ``other`` cores' worth of another process's work."""
    busy = 2 * process + other * step
    traces, probes = [], {}
    for rank in range(2):
        t = CommTrace(rank=rank, origin=0.0)
        t.events = [Event(rank, "backward", k * step + 4.0, k * step + 4.0 + backward_wall,
                          cpu=backward_cpu) for k in range(STEPS)]  # fmt: skip
        traces.append(t)
        probes[rank] = probe(cpu, process, busy if rank == 0 else None, step)
    windows = {r: [(k * step, (k + 1) * step) for k in range(STEPS)] for r in range(2)}
    return Run("ring_allreduce", traces, windows, dict(ROW), probes)


def test_the_probe_clocks_give_per_step_seconds_and_the_other_load():
    run = ring_run()
    assert step_clock(run.probes[0], "cpu") == pytest.approx([5.0, 5.0, 5.0])
    assert step_clock(run.probes[1], "machine_busy") is None  # read on rank 0 only
    assert step_clock({"starts": [0.0]}, "cpu") is None  # a probe from before the clocks
    # the machine was busy 2 x 6 + 10 s a step, the ranks' own processes 2 x 6 s
    assert other_load(run.probes) == pytest.approx(1.0)
    assert run.other_load == pytest.approx(1.0)
    assert run.clock_per_step("process_cpu") == pytest.approx({0: 6.0, 1: 6.0})


def test_compute_is_the_cpu_time_the_ranks_ran_not_their_wall_time():
    run = ring_run(cpu=5.0, process=6.0)
    graph = run.graph(PRESETS["loopback"])
    # every step is 10 s of compute on the wall clock, 5 s of CPU on the main thread
    assert cpu_ratio(run, graph) == pytest.approx(0.5)
    prof = cpu_profile(run, graph)
    assert prof.cpu_based
    assert prof.compute_s == pytest.approx(5.0)
    assert prof.backward_s == pytest.approx(2.0)  # the span's own CPU time, not its 4 s
    assert prof.batch_s == pytest.approx(3.0)  # 3/2 of the backward
    assert prof.comm_cpu_s == pytest.approx(1.0)  # process less main thread: 6 - 5


def test_a_span_without_cpu_time_is_scaled_by_the_ranks_share_of_a_core():
    # a trace written before spans kept their CPU time: 6 s of backward at half a core
    run = ring_run(backward_cpu=None, backward_wall=6.0)
    prof = cpu_profile(run, run.graph(PRESETS["loopback"]))
    assert prof.backward_s == pytest.approx(6.0 * 0.5)


def test_each_timed_figure_is_its_best_round_and_the_offset_reads_the_fastest():
    fast = ring_run(cpu=5.0, backward_cpu=2.5)
    slow = ring_run(cpu=4.0, backward_cpu=2.0, step=12.0)
    base = base_profile([slow, fast], PRESETS["loopback"])
    assert base.fastest_run is fast and base.fastest.backward_s == pytest.approx(2.5)
    assert base.profile.backward_s == pytest.approx(2.0)  # the least of the two rounds
    assert base.profile.compute_s == pytest.approx(4.0)
    # communication CPU (process less main thread: 1 s and 2 s) swings: the median round
    assert base.profile.comm_cpu_s == pytest.approx(1.5)
    assert base.noise.rounds == 2
    assert base.noise.steps_s == pytest.approx([12.0, 10.0])
    assert base.noise.as_dict()["spread"] == pytest.approx(0.2)
    assert spread([10.0]) is None
    with pytest.raises(ValueError, match="no base runs"):
        base_profile([], PRESETS["loopback"])


def message_pair(nbytes: int, post: float, took: float, rank: int) -> Message:
    op, peer = ("send", 1) if rank == 0 else ("recv", 0)
    # the receiver blocked from its post: the transfer is post to arrival
    return Message(rank, op, peer, nbytes, post, post + took, wait_start=post)


def test_messages_are_priced_by_the_fastest_quarter_of_each_size():
    took = {1_000: [1.0, 1.1, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0],
            101_000: [2.0, 2.1, 9.0, 9.5, 10.0, 11.0, 12.0, 13.0]}  # fmt: skip
    traces = [CommTrace(rank=r, origin=0.0) for r in range(2)]
    at = 0.0
    for nbytes, times in took.items():
        for seconds in times:
            for rank in range(2):
                traces[rank].messages.append(message_pair(nbytes, at, seconds, rank))
            at += 100.0
    run = Run("ring", traces, None)
    link = fastest_link([run], PRESETS["loopback"])
    expected = fit_link([(1_000, 1.0), (1_000, 1.1), (101_000, 2.0), (101_000, 2.1)])
    assert (link.alpha, link.beta) == pytest.approx((expected.alpha, expected.beta))
    assert link.beta == pytest.approx(1e-5)  # 1 s more for 100 kB more
    # no matched transfer: the fallback
    assert fastest_link([Run("x", [CommTrace(0, 0.0)], None)], PRESETS["pcie"]) is PRESETS["pcie"]


def test_a_span_records_the_cpu_time_of_its_thread():
    trace = CommTrace(rank=0)
    with trace.span("busy"):
        end = time.thread_time() + 0.02
        while time.thread_time() < end:
            pass
    with trace.span("asleep"):
        time.sleep(0.05)
    busy, asleep = trace.events
    assert busy.cpu >= 0.02 and busy.cpu <= busy.end - busy.start + 1e-3
    assert asleep.end - asleep.start >= 0.05 and asleep.cpu < 0.01
    mark = trace.mark()
    closed = trace.close("backward", mark)
    assert closed is trace.events[-1] and closed.cpu is not None


def test_the_offset_is_read_off_a_base_round_beside_no_other_load():
    from lightning_par.simulate.links import Link, Topology
    from lightning_par.simulate.validate import scaled

    free = Topology(Link("free", 0.0, 0.0), Link("free", 0.0, 0.0))
    loaded = ring_run(other=1.0, step=10.0)  # the fastest round, beside a busy core
    quiet = ring_run(other=0.0, step=12.0)
    base = base_profile([loaded, quiet], PRESETS["loopback"])
    assert base.fastest_run is quiet
    # the quiet round: 12 s measured, its 5 s of compute modelled (a processor per rank)
    assert scaled(base, 4, free)[2] == pytest.approx(12.0 - 5.0)
    # every round beside other load: what the model leaves out cannot be read, none carried
    only_loaded = base_profile([loaded, ring_run(other=1.0, step=12.0)], PRESETS["loopback"])
    assert only_loaded.fastest_run is loaded
    assert scaled(only_loaded, 4, free)[2] == 0.0
