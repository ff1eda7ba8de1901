"""The keeper a fault-tolerant rank runs behind under torchrun or srun
(:mod:`lightning_par.launch.keeper`): what the launcher sees of its rank's end.

Each case runs a small script in a subprocess, as the launcher would: at ``keep`` the
process becomes the keeper and starts the rank as one more run of the script; the rank
ends one way, and the script's exit status, its output and what ran where are checked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_par.launch.keeper import RESTARTS_ENV, restarts_allowed

ROOT = Path(__file__).parent.parent

_SCRIPT = """
import atexit, os, signal, sys
from lightning_par.launch.keeper import KEPT_ENV, keep
where = "rank" if os.environ.get(KEPT_ENV) else "keeper"
print("before keep in", where, flush=True)
{before}
atexit.register(lambda: print("atexit in", where, flush=True))
command = [sys.executable, "-c", sys.argv[1], sys.argv[1]]
keep("rank 1", {tolerated}, command, replaceable=True)
keep("rank 1", {tolerated}, command)  # (a later trainer call: no second keeper)
print("after keep in", where, flush=True)
{end}
"""


def _run(end: str, tolerated: bool, before: str = "", **env: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent(_SCRIPT.format(tolerated=tolerated, end=end, before=before))
    return subprocess.run([sys.executable, "-c", code, code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **env})  # fmt: skip


def test_a_rank_killed_where_the_job_goes_on_without_it_ends_well_with_one_line():
    done = _run("os.kill(os.getpid(), signal.SIGKILL)", tolerated=True)
    assert done.returncode == 0, done
    # the script's lines before keep run once more, in the rank; after it, only there
    assert done.stdout.splitlines() == ["before keep in keeper", "before keep in rank",
                                        "after keep in rank"], done.stdout  # fmt: skip
    assert done.stderr == (
        "lightning_par: rank 1 was killed by SIGKILL; the other ranks go on without it\n"
    )


def test_a_rank_that_exits_passes_its_code_and_runs_the_scripts_atexit_once():
    done = _run("sys.exit(3)", tolerated=True)
    assert done.returncode == 3, done
    assert done.stdout.splitlines()[-2:] == ["after keep in rank", "atexit in rank"], done
    assert "atexit in keeper" not in done.stdout and done.stderr == ""


def test_a_rank_that_computed_on_several_threads_before_its_keeper_computes_on_them_after():
    """A fork of a process that ran a multi-threaded OpenMP region hangs in its next one
    (GNU OpenMP's thread pool is not in the child): the rank is a run of its own."""
    warm = "import torch; x = torch.randn(600, 600); y = x @ x"
    done = _run("print('computed', float((x @ x).sum()) != 0.0, torch.get_num_threads())",
                tolerated=True, before=warm, OMP_NUM_THREADS="2")  # fmt: skip
    assert done.returncode == 0, done
    assert "computed True 2" in done.stdout.splitlines(), done.stdout


_LOST_UNLESS_REPLACEMENT = (
    "print('replacement ran', flush=True) if os.environ.get('LIGHTNING_PAR_JOIN') "
    "else os.kill(os.getpid(), signal.{signal})"
)


def test_a_lost_rank_is_replaced_as_often_as_torchruns_max_restarts_allow():
    """torchrun's agent would restart every worker of the node from the start; the keeper
    starts the lost one again, as a replacement that joins (``LIGHTNING_PAR_JOIN``). With no
    restart allowed nothing is replaced (the first test's lines), nor is a rank stopped on
    purpose (SIGTERM)."""
    end = _LOST_UNLESS_REPLACEMENT.format(signal="SIGKILL")
    done = _run(end, tolerated=True, TORCHELASTIC_MAX_RESTARTS="1")
    assert done.returncode == 0, done
    assert done.stdout.splitlines()[-3:] == ["after keep in rank", "replacement ran",
                                             "atexit in rank"], done  # fmt: skip
    assert done.stderr == (
        "lightning_par: rank 1 was killed by SIGKILL; the other ranks go on without it, and "
        "its replacement starts to join them (0 more restart(s) allowed)\n"
    ), done.stderr
    stopped = _LOST_UNLESS_REPLACEMENT.format(signal="SIGTERM")
    done = _run(stopped, tolerated=True, LIGHTNING_PAR_MAX_RESTARTS="1")
    assert done.returncode == 0 and "replacement" not in done.stdout + done.stderr, done


def test_how_often_a_lost_rank_is_replaced_is_read_from_torchrun_or_the_variable(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS", raising=False)
    monkeypatch.delenv(RESTARTS_ENV, raising=False)
    assert restarts_allowed() == 0
    monkeypatch.setenv(RESTARTS_ENV, "2")
    assert restarts_allowed() == 2
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")  # (torchrun's says it first)
    assert restarts_allowed() == 1
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS")
    monkeypatch.setenv(RESTARTS_ENV, "one")
    with pytest.raises(ValueError, match="LIGHTNING_PAR_MAX_RESTARTS='one': give how many"):
        restarts_allowed()


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_rank_the_job_cannot_lose_ends_its_keeper_by_the_same_signal(signum):
    done = _run(f"os.kill(os.getpid(), {int(signum)})", tolerated=False)
    assert done.returncode == -signum, done
    assert done.stderr == "", done.stderr


def test_the_keeper_serving_the_store_stays_until_every_rank_ended():
    """Under SLURM rank 0's keeper serves the job's store: once its rank ended it counts it
    and waits for the other ranks' keepers to count theirs (here: this test, for rank 1)."""
    import time

    import torch.distributed as dist

    from lightning_par.launch.keeper import ENDED_KEY
    from lightning_par.launch.store_host import StoreHost

    host = StoreHost()
    try:
        code = textwrap.dedent(f"""
            import sys
            from functools import partial
            from lightning_par.launch.keeper import count_end, keep
            ended = partial(count_end, "127.0.0.1", {host.port}, 2)
            keep("rank 0", True, [sys.executable, "-c", sys.argv[1], sys.argv[1]], after=ended)
            print("rank ends", flush=True)
        """)
        keeper = subprocess.Popen([sys.executable, "-c", code, code], cwd=ROOT, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        store = dist.TCPStore("127.0.0.1", host.port, is_master=False, wait_for_workers=False)
        deadline = time.monotonic() + 60
        while store.add(ENDED_KEY, 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)  # (rank 0 ended, and its keeper counted it)
        time.sleep(1.0)
        assert keeper.poll() is None, keeper.communicate()  # still serving: rank 1 runs
        store.add(ENDED_KEY, 1)  # rank 1's keeper counts its end
        out, err = keeper.communicate(timeout=30)
        assert keeper.returncode == 0 and out == "rank ends\n" and err == "", (out, err)
    finally:
        host.close()


# ---- popen: the script's process keeps rank 0 (lightning_par.launch.script_keeper) ----------
_POPEN_KEEPER = """
import sys
from lightning_par.launch.script_keeper import run_rank_0_behind_keeper
run_rank_0_behind_keeper("rank 0", [sys.executable, "-c", sys.argv[1]], None)
"""
#: rank 0 starts a rank that ends a moment after it (as popen's scripts outlive a lost rank 0)
_RANK_0 = """
import os, signal, subprocess, sys
subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(1.5); "
                  "print('survivor ends', flush=True); sys.exit({survivor})"])
{end}
"""


@pytest.mark.parametrize(
    "end, survivor, code, line",
    [  # (a survivor that ends well, exit code 0: tests/test_fault_tolerance.py)
        ("os.kill(os.getpid(), signal.SIGKILL)", 4, 4, True),  # lost; a survivor fails
        ("sys.exit(3)", 0, 3, False),  # rank 0's own end, after its ranks'
    ],
    ids=["rank-0-killed-survivor-fails", "rank-0-exits"],
)
def test_the_popen_keeper_waits_for_every_rank_and_ends_as_the_job_did(end, survivor, code, line):
    rank_0 = _RANK_0.format(survivor=survivor, end=end)
    done = subprocess.run([sys.executable, "-c", _POPEN_KEEPER, rank_0], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == code, done
    assert done.stdout == "survivor ends\n", done  # (waited for the rank rank 0 started)
    named = "lightning_par: rank 0 was killed by SIGKILL; the other ranks go on without it\n"
    assert done.stderr == (named if line else ""), done.stderr
