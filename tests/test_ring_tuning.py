"""The ring's message sizes chosen for the machine (:mod:`lightning_par.collectives.ring_tuning`):
the rule by cores, the calibration, rank 0's choice for every rank, the cache, and the
ring strategy and ``bench allreduce`` running with them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import torch
from torch.utils.data import DataLoader

from lightning_par.collectives import ring_tuning
from lightning_par.collectives.cost_model import predict
from lightning_par.collectives.ring import ring_allreduce, segments_per_chunk
from lightning_par.collectives.ring_tuning import CANDIDATES, CORE_PER_RANK, SHARED_CORES
from lightning_par.comm import CommTrace, run_on_ranks
from lightning_par.strategies.allreduce import AllReduceStrategy
from tests.test_allreduce_strategies import (
    PER_RANK,
    RankShard,
    _reference_on_one_rank,
    flat_weights,
    global_batches,
    make_model,
    trainer,
)

MIB = 1 << 20


def test_the_rule_gives_few_large_messages_to_a_core_per_rank_and_more_to_shared_cores():
    assert ring_tuning.rule(2, cores=2) is CORE_PER_RANK
    assert ring_tuning.rule(16, cores=16) is CORE_PER_RANK
    assert ring_tuning.rule(4, cores=2) is SHARED_CORES
    # 1M floats on 2 ranks: 2 MiB chunks, one message each with a core per rank, two shared
    assert segments_per_chunk(1 << 19, 4, CORE_PER_RANK.segment_bytes,
                              CORE_PER_RANK.min_split_bytes) == 1  # fmt: skip
    assert segments_per_chunk(1 << 19, 4, SHARED_CORES.segment_bytes,
                              SHARED_CORES.min_split_bytes) == 2  # fmt: skip


def test_the_fastest_candidate_is_the_one_least_behind_the_best_at_every_size():
    medians = {t.name: [10.0, 10.0, 10.0] for t in CANDIDATES}
    medians["medium"] = [9.0, 12.0, 10.0]  # best at one size, far behind at another
    medians["gloo's sizes"] = [10.0, 9.5, 9.5]
    assert ring_tuning.fastest(medians).name == "gloo's sizes"


def test_a_calibration_is_kept_per_machine_and_an_unreadable_cache_is_ignored(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("LIGHTNING_PAR_CACHE", str(tmp_path))
    key = ring_tuning.machine_key(2, 2, "gloo")
    assert ring_tuning.cached(key) is None
    ring_tuning.keep(key, CANDIDATES[2], {t.name: [1.0, 2.0, 3.0] for t in CANDIDATES})
    assert ring_tuning.cached(key) == CANDIDATES[2]
    assert ring_tuning.cached(ring_tuning.machine_key(4, 4, "gloo")) is None
    entry = json.loads(ring_tuning.cache_file().read_text())[key]
    assert entry["sizes"] == list(ring_tuning.CALIBRATION_SIZES) and "measured" in entry
    ring_tuning.cache_file().write_text("{not json")
    assert ring_tuning.cached(key) is None
    assert [p.name for p in tmp_path.iterdir()] == ["ring_tuning.json"]  # no partial file left


def test_message_counts_follow_the_tuning_in_the_ring_and_in_its_cost_model():
    for tuning in CANDIDATES:
        shape = {"segment_bytes": tuning.segment_bytes, "min_split_bytes": tuning.min_split_bytes}
        measured = tuple(run_on_ranks(_messages_sent, 2, tuning))
        assert predict("ring", 1 << 22, 2, **shape).messages_sent == measured, tuning.name


def _messages_sent(rank: int, world_size: int, tuning) -> int:
    trace = CommTrace(rank)
    tensor = torch.full((1 << 22,), float(rank + 1))
    ring_allreduce(tensor, trace=trace, **tuning.options())
    assert torch.equal(tensor, torch.full_like(tensor, 3.0))
    return trace.messages_sent


def _choose(rank: int, world_size: int, folders: list[str], calibrate: bool):
    os.environ["LIGHTNING_PAR_CACHE"] = folders[rank]
    choice = ring_tuning.choose(None, world_size, calibrate_now=calibrate)
    return choice.tuning, choice.source, choice.medians_ms


def test_every_rank_runs_rank_0s_choice(tmp_path):
    # rank 0 kept a calibration naming gloo's sizes; rank 1's cache is empty (another node)
    folders = [str(tmp_path / "rank0"), str(tmp_path / "rank1")]
    os.environ["LIGHTNING_PAR_CACHE"] = folders[0]
    try:
        ring_tuning.keep(ring_tuning.machine_key(2, 2, "gloo"), CANDIDATES[2], {})
    finally:
        del os.environ["LIGHTNING_PAR_CACHE"]
    (t0, source0, _), (t1, _, _) = run_on_ranks(_choose, 2, folders, False)
    assert t0 == t1 == CANDIDATES[2] and source0.startswith("calibrated before")


def test_a_calibration_times_every_candidate_on_every_rank_and_keeps_rank_0s_choice(tmp_path):
    folders = [str(tmp_path / "rank0"), str(tmp_path / "rank1")]
    (t0, source, medians0), (t1, _, medians1) = run_on_ranks(_choose, 2, folders, True)
    assert t0 == t1 and source == "calibrated now"
    assert medians0 == medians1  # every rank saw the slowest rank's times
    assert set(medians0) == {t.name for t in CANDIDATES}
    assert all(len(ms) == len(ring_tuning.CALIBRATION_SIZES) and min(ms) > 0
               for ms in medians0.values())  # fmt: skip
    assert t0 == ring_tuning.fastest(medians0)
    kept = json.loads((tmp_path / "rank0" / "ring_tuning.json").read_text())
    assert [entry["name"] for entry in kept.values()] == [t0.name]
    assert not (tmp_path / "rank1").exists()  # only rank 0 writes


def test_the_ring_strategy_calibrates_at_start_up_when_asked_and_trains_as_one_process(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("LIGHTNING_PAR_CACHE", str(tmp_path))
    x, y = global_batches(2)
    model = make_model("cnn")
    run = trainer(AllReduceStrategy("ring", calibrate_ring=True), 2)
    run.fit(model, DataLoader(RankShard(x, y, 2), batch_size=PER_RANK))
    kept = json.loads(ring_tuning.cache_file().read_text())
    assert list(kept) == [ring_tuning.machine_key(2, 2, "gloo")]
    (reference,) = run_on_ranks(_reference_on_one_rank, 1, "cnn", 2)
    assert np.abs(flat_weights(model).numpy() - reference).max() < 1e-5


def test_bench_allreduce_reports_the_tuning_it_ran_with(tmp_path):
    env = {**os.environ, "LIGHTNING_PAR_CACHE": str(tmp_path)}
    command = [sys.executable, "-m", "lightning_par.bench", "allreduce", "--world-size", "2",
               "--sizes", "4096", "--algorithms", "ring", "--repeats", "3", "--json"]  # fmt: skip
    rule = json.loads(subprocess.run(command, env=env, capture_output=True, text=True,
                                     check=True, timeout=300).stdout)  # fmt: skip
    expected = ring_tuning.rule(2).describe()
    assert rule["ring_tuning"].startswith(expected) and rule["ring_calibration_ms"] is None
    timed = json.loads(subprocess.run([*command, "--calibrate"], env=env, capture_output=True,
                                      text=True, check=True, timeout=300).stdout)  # fmt: skip
    assert timed["ring_tuning"].endswith("calibrated now")
    assert set(timed["ring_calibration_ms"]) == {t.name for t in CANDIDATES}
    again = json.loads(subprocess.run(command, env=env, capture_output=True, text=True,
                                      check=True, timeout=300).stdout)  # fmt: skip
    assert "calibrated before" in again["ring_tuning"]
