"""The keeper a fault-tolerant rank forks under torchrun or srun
(:mod:`lightning_par.launch.keeper`): what the launcher sees of its rank's end.

Each case runs a small script in a subprocess (the keeper forks and ends the process it
runs in): the rank (the child) ends one way, and the script's exit status, its output and
what ran after ``keep`` are checked."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent

_SCRIPT = """
import atexit, os, signal, sys
from lightning_par.launch.keeper import keep
atexit.register(lambda: print("atexit in", "parent" if os.getpid() == {pid} else "child"))
keep("rank 1", tolerated={tolerated})
keep("rank 1", tolerated={tolerated})  # (a later trainer call: no second fork)
print("rank runs", os.getpid() != {pid}, flush=True)
{end}
"""


def _run(end: str, tolerated: bool) -> subprocess.CompletedProcess:
    code = textwrap.dedent(
        "import os\nPID = os.getpid()\n"
        + _SCRIPT.replace("{pid}", "PID").format(tolerated=tolerated, end=end)
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_a_rank_killed_where_the_job_goes_on_without_it_ends_well_with_one_line():
    done = _run("os.kill(os.getpid(), signal.SIGKILL)", tolerated=True)
    assert done.returncode == 0, done
    assert done.stdout.splitlines() == ["rank runs True"], done.stdout  # once, in the child
    assert done.stderr == (
        "lightning_par: rank 1 was killed by SIGKILL; the other ranks go on without it\n"
    )


def test_a_rank_that_exits_passes_its_code_and_runs_the_scripts_atexit_once():
    done = _run("sys.exit(3)", tolerated=True)
    assert done.returncode == 3, done
    assert done.stdout.splitlines() == ["rank runs True", "atexit in child"], done.stdout
    assert done.stderr == ""


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
            from functools import partial
            from lightning_par.launch.keeper import count_end, keep
            keep("rank 0", tolerated=True, after=partial(count_end, "127.0.0.1", {host.port}, 2))
            print("rank ends", flush=True)
        """)
        keeper = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True,
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
