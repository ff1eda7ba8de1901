"""A benchmark survives a failing peer and says what it ran on (``lightning_par.bench._peers``,
``._environment``): a peer that raises on one rank, a rank that dies inside a peer and a
peer past its time limit each become a failure that names the peer and the error, ours are
still measured, and a failure of ours still raises."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import time

import pytest
import torch
import torch.distributed as dist

from lightning_par.bench.__main__ import available
from lightning_par.bench._environment import RunEnvironment, environment_line, print_result
from lightning_par.bench._peers import attempt, run_with_peers
from lightning_par.launch.processes import TimeLimitExceeded, time_limit
from lightning_par.launch.run import RankFailed


def _ours(rank: int) -> float:
    """Our part of a run: a sum over the default group."""
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _peer_raises_on_rank_0(rank: int, world: int, *, guard) -> tuple:
    group = guard.group("flaky")

    def flaky() -> str:
        if rank == 0:
            raise RuntimeError("[gloo/transport] Pair is not connected\nsecond line")
        dist.all_reduce(torch.ones(1), group=group)  # waits for rank 0: the group's timeout
        return "ran"

    first = guard.run("flaky", flaky)
    again = guard.run("flaky", lambda: "ran again")  # a failed peer is not run again
    return first, again, _ours(rank)


def test_a_peer_raising_on_one_rank_fails_on_every_rank_and_ours_go_on(monkeypatch):
    monkeypatch.setenv("LIGHTNING_PAR_PEER_TIMEOUT", "3")
    start = time.monotonic()
    ranks, failed = run_with_peers(_peer_raises_on_rank_0, 2, timeout=120)
    assert time.monotonic() - start < 100  # rank 1 waited the peer's 3 s, not the run's 120
    assert ranks == [(None, None, 3.0), (None, None, 3.0)]
    (error,) = failed.values()
    assert list(failed) == ["flaky"]
    # one line: every rank's failure, rank 0's the cause, rank 1's its echo (the timeout)
    assert error.startswith("rank 0: RuntimeError: [gloo/transport] Pair is not connected; rank 1:")
    assert "\n" not in error and "second line" not in error


def _rank_dies_in_peer(rank: int, world: int, *, guard) -> tuple:
    group = guard.group("deadly")

    def deadly() -> None:
        if rank == 1:
            os._exit(3)
        dist.all_reduce(torch.ones(1), group=group)

    guard.run("deadly", deadly)
    return _ours(rank), dict(guard.failed)


def test_a_rank_dying_inside_a_peer_starts_the_ranks_again_without_it():
    ranks, failed = run_with_peers(_rank_dies_in_peer, 2, timeout=60)
    assert [ours for ours, _ in ranks] == [3.0, 3.0]
    assert list(failed) == ["deadly"]
    assert "rank 1 of 2 died with exit code 3" in failed["deadly"]
    # the second start knew the peer had failed and did not run it
    assert all(seen == failed for _, seen in ranks)


def _rank_hangs_in_peer(rank: int, world: int, *, guard) -> float:
    def sleepy() -> None:
        if rank == 1:
            time.sleep(600)  # hangs outside any collective: only the others' wait ends

    guard.run("sleepy", sleepy)
    return _ours(rank)


def test_a_rank_hanging_inside_a_peer_starts_the_ranks_again_without_it():
    # rank 0 waits for rank 1 to agree on the peer, on the default group, for the run's
    # 4 s: it raises inside the peer, and the ranks start again without it
    ranks, failed = run_with_peers(_rank_hangs_in_peer, 2, timeout=4)
    assert ranks == [3.0, 3.0]
    assert list(failed) == ["sleepy"]
    assert failed["sleepy"].startswith("a rank was lost in it: rank 0 of 2 raised: ")


def _ours_raises(rank: int, world: int, *, guard) -> None:
    guard.run("fine", lambda: None)
    if rank == 0:
        raise ValueError("our bug")
    _ours(rank)


def _ours_dies(rank: int, world: int, *, guard) -> None:
    guard.run("fine", lambda: None)
    if rank == 1:
        os._exit(4)
    _ours(rank)


@pytest.mark.parametrize("fn, shown", [(_ours_raises, "ValueError: our bug"),
                                       (_ours_dies, "died with exit code 4")])  # fmt: skip
def test_a_failure_of_ours_is_not_taken_for_a_peers(fn, shown):
    with pytest.raises(RankFailed, match=shown):
        run_with_peers(fn, 2, timeout=60)


def test_a_peer_past_its_limit_is_a_failure_and_the_outer_limit_still_holds():
    with pytest.raises(TimeLimitExceeded, match="the benchmark's own"):
        with time_limit(2.0, "the benchmark's own limit"):
            result, error = attempt("sleeper", lambda: time.sleep(30), limit_s=0.3)
            assert result is None
            assert error == "TimeLimitExceeded: peer 'sleeper' ran past its 0.3 s limit"
            assert attempt("fine", lambda: 7, limit_s=5.0) == (7, None)
            # the outer limit, armed again, ends a peer's run too: not the peer's failure
            attempt("slow", lambda: time.sleep(30), limit_s=20.0)


def test_the_environment_is_in_the_text_and_the_json(capsys):
    started = RunEnvironment.now()
    print_result({"rows": [1]}, lambda r: f"rows: {r['rows']}", True, started)
    doc = json.loads(capsys.readouterr().out)
    env = doc["environment"]
    assert doc["rows"] == [1]
    assert env["torch"] == torch.__version__ and env["cores"] == os.cpu_count()
    assert {"lightning", "python", "machine", "gpus", "load_1m_start", "load_1m_end"} <= set(env)
    print_result({"rows": [1]}, lambda r: f"rows: {r['rows']}", False, started)
    first, second = capsys.readouterr().out.splitlines()
    assert first.startswith(f"ran on torch {torch.__version__}, Lightning ")
    assert f"{os.cpu_count()} cores" in first and second == "rows: [1]"
    assert environment_line(env) == first


#: every benchmark (``malloc`` is a helper the pipeline benchmark uses, with no ``main``)
BENCHMARKS = {name: importlib.import_module(f"lightning_par.bench.{name}") for name in available()}


@pytest.mark.parametrize("name", [n for n, m in BENCHMARKS.items() if hasattr(m, "main")])
def test_every_benchmark_prints_through_the_shared_helper(name):
    source = inspect.getsource(BENCHMARKS[name].main)
    assert "RunEnvironment.now()" in source and "print_result(" in source, name
