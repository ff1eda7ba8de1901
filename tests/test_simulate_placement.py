"""Data-parallel ranks on a few cores by hand: fair sharing where they cannot be placed
evenly, the machine a validation records, what the model leaves out of the small step."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_par.simulate.builders import build
from lightning_par.simulate.links import Link, Topology
from lightning_par.simulate.ops import After
from lightning_par.simulate.profile import Profile
from lightning_par.simulate.scale import predict_split, predict_step

LATENCY_ONLY = Topology(Link("a", alpha=1.0, beta=0.0), Link("a", alpha=1.0, beta=0.0))


def data_parallel(backward_s: float = 0.0) -> Profile:
    return Profile("x", "allreduce", 2, 2, 8, 0.0, compute_s=10.0, batch_s=10.0,
                   backward_s=backward_s, grad_bytes=4000, buckets=2)  # fmt: skip


def test_replicas_that_cannot_be_placed_evenly_share_the_cores_fairly():
    # 3 ranks of 10 * 2/3 s each on 2 cores: 10 s, and the ring's 2(p-1) latencies; no wait
    # for a core left idle (the training runs of issue #42 showed none)
    prof = data_parallel()
    step, split = predict_split(prof, 3, LATENCY_ONLY, cores=2)
    assert step == pytest.approx(10 + 4)
    assert split["compute"] == pytest.approx(10.0) and split["waiting"] == pytest.approx(0.0)
    # beside half a core's worth of other work the ranks share the 1.5 cores left
    assert predict_step(prof, 3, LATENCY_ONLY, cores=2, other_load=0.5) == pytest.approx(
        20 / 1.5 + 4
    )
    # a machine of its own per rank: the compute of one rank
    assert predict_step(prof, 3, LATENCY_ONLY) == pytest.approx(20 / 3 + 4)


def test_buckets_start_when_backward_has_filled_them():
    graph = build(data_parallel(backward_s=6.0), 3, LATENCY_ONLY, cores=2)
    after = [op for op in graph.lanes[(0, "bg")] if isinstance(op, After)]
    assert len(after) == 2 and all(op.lane == (0, "main") for op in after)


def test_the_validation_records_the_machine_it_measured(monkeypatch, tmp_path):
    import json

    from lightning_par.simulate import machine
    from lightning_par.simulate.sharing_cost import Steps

    asked = []

    def timed(model, batch, sizes, cores, threads):
        asked.append((model, batch, sizes, cores, threads))
        return Steps({2: 0.03, 3: 0.02, 4: 0.015}, {3: 1.1, 4: 1.05})

    monkeypatch.setattr(machine, "measure_step_cpu", timed)
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 2)
    found = machine.measure_machine((2, 3, 4), "CifarCNN", 48)
    assert asked == [("CifarCNN", 48, (2, 3, 4), 2, 1)]
    assert found == (2, 1, {3: 1.1, 4: 1.05}, {2: 0.03, 3: 0.02, 4: 0.015}, ())
    # --reuse reads what the runs recorded, not this machine
    folder = tmp_path / "0-p2-ring_allreduce"
    folder.mkdir()
    (folder / "row.json").write_text(json.dumps(found.as_row()))
    assert machine.kept_machine({("ring_allreduce", 2): [folder]}) == found
    assert len(asked) == 1
    # every trial beside other processes' load: not measured, and it says so
    monkeypatch.setattr(machine, "measure_step_cpu", lambda *args: Steps({}, {}))
    busy = machine.measure_machine((2, 3, 4), "CifarCNN", 48)
    assert busy.sharing_cost == {} and busy.step_cpu == {}
    assert busy.unmeasured == ("step CPU at each size, cost of turns",)


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
