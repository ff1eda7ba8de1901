"""A lost rank, killed or frozen by ``LIGHTNING_PAR_FAULT``, ends the run within a bounded
time with one line naming the rank, how it was lost and the newest checkpoint; no
traceback, no process and no temporary file or folder is left (a plain script in a fresh
interpreter, Lightning choosing the launch: fork on this machine, popen or forkserver when
asked). Where the ranks name a lost peer themselves (torchrun, popen's rank 0):
``tests/test_lost_peers.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _script_runs import run_script

from lightning_par.launch.faults import FAULT_ENV, Fault, parse_fault, planned_faults
from lightning_par.launch.lost import (
    LAUNCHER_RANK_ENV,
    REPORTS_ENV,
    how_it_ended,
    leave_report,
    make_private_folder,
    read_reports,
)
from lightning_par.launch.processes import kill_tree
from lightning_par.strategies.allreduce import AllReduceStrategy

HERE = Path(__file__).parent
SCRIPT = HERE / "_lost_rank_script.py"
DEAD_PEER_S = 2.0  # the script's dead_peer_timeout
CHECKPOINT = "the newest checkpoint is {}/epoch=0-step=2.ckpt"  # saved before step 3
#: (scenario, what the line starts with) for one fork run: each plugin family, a first and a
#: last rank, each way of being lost
FORK = [
    ("ring_allreduce:kill:rank=1:step=3", "rank 1 was killed by SIGKILL; every rank was stopped"),
    ("local_sgd:freeze:rank=0:step=3", "rank 0 stopped responding for"),
    ("gpipe:exit:rank=1:step=3:code=5", "rank 1 exited with code 5; every rank was stopped"),
    ("zero:kill:rank=0:step=3", "rank 0 was killed by SIGKILL; every rank was stopped"),
    ("async_sgd:freeze:rank=1:step=3", "worker 1 (rank 1) stopped responding for"),
]
POPEN = [
    ("ring_allreduce:freeze:rank=1:step=3", "rank 1 stopped responding for"),
    ("parameter_server:kill:rank=1:step=3", "worker 1 (rank 1) was killed by SIGKILL; every rank"),
]
#: a forkserver launch: worker 0 starts its servers from a forkserver of its own, and is
#: killed by the launcher once worker 1 is lost
FORKSERVER = [("parameter_server:kill:rank=1:step=3", "worker 1 (rank 1) was killed by SIGKILL")]


# ---- the pieces, without processes ---------------------------------------------------------
def test_a_fault_is_read_from_its_text_and_strikes_its_rank_at_its_step():
    assert parse_fault("kill:rank=1:step=12") == Fault("kill", 12, rank=1)
    assert parse_fault("exit:server=0:step=3:code=7") == Fault("exit", 3, server=0, code=7)
    fault = parse_fault("freeze:rank=2:step=5")
    assert fault.due(5, rank=2) and not fault.due(4, rank=2) and not fault.due(5, rank=1)
    assert not fault.due(5, server=2)  # a rank's fault never strikes a server
    for wrong in ("kill:rank=1", "kill:step=3", "boom:rank=1:step=3", "kill:rank=1:step=x",
                  "kill:rank=1:server=0:step=3", "kill:rank=1:step=3:code=2"):  # fmt: skip
        with pytest.raises(ValueError, match=f"{FAULT_ENV}=.*write KIND:rank=R:step=S"):
            parse_fault(wrong)


def test_several_faults_are_planned_separated_by_commas(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "kill:rank=1:step=3, kill:server=0:step=3")
    assert planned_faults() == [Fault("kill", 3, rank=1), Fault("kill", 3, server=0)]
    monkeypatch.setenv(FAULT_ENV, "")
    assert planned_faults() == []


def test_a_strategy_refuses_a_wrong_fault_or_dead_peer_timeout(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "kill:rank=one:step=3")
    with pytest.raises(ValueError, match=FAULT_ENV):
        AllReduceStrategy("ring")
    monkeypatch.delenv(FAULT_ENV)
    with pytest.raises(ValueError, match="dead_peer_timeout must be a number of seconds > 0"):
        AllReduceStrategy("ring", dead_peer_timeout=0)
    assert AllReduceStrategy("ring", dead_peer_timeout=5).dead_peer_timeout == 5


def test_how_a_process_ended_in_words():
    assert how_it_ended(-9) == "was killed by SIGKILL"
    assert how_it_ended(-19) == "was killed by SIGSTOP"
    assert how_it_ended(3) == "exited with code 3"


def test_reports_reach_the_launchers_folder_made_by_their_first_writer(tmp_path, monkeypatch):
    folder = tmp_path / "reports"
    monkeypatch.delenv(REPORTS_ENV, raising=False)
    assert not leave_report(1, "rank 1 stopped responding")  # no launcher of ours: printed
    monkeypatch.setenv(REPORTS_ENV, str(folder))
    assert not folder.exists()  # nothing failed, nothing made
    assert leave_report(1, "rank 1 stopped responding")
    assert read_reports(str(folder)) == [(1, "rank 1 stopped responding")]
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    monkeypatch.setenv(LAUNCHER_RANK_ENV, "0")  # popen: the launcher is rank 0 itself
    assert not leave_report(0, "rank 0 stopped responding")  # it could not read it
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    assert not make_private_folder(str(link))  # someone's link: never written through


# ---- a user's script -------------------------------------------------------------------------
def _run(tmp_path: Path, scenarios: list[str], limit_s: float, **env: str):
    """Run the script on ``scenarios``: its exit code, each output line with the time it
    arrived, the processes and the temporary files it left."""
    run = run_script([sys.executable, "-u", str(SCRIPT), *scenarios], tmp_path, limit_s, env)
    return run.code, run.lines, run.session, run.left


def _check(tmp_path: Path, expected: list[tuple[str, str]], run) -> list[float]:
    """Every scenario's line and bound; the seconds from each fault to its line."""
    code, lines, session, left = run
    text = "".join(line for _, line in lines)
    assert code == 0, text[-4000:]
    assert "Traceback" not in text and "ProcessExitedException" not in text, text[-4000:]
    assert session == [] and left == [], (session, left)
    struck = [t for t, line in lines if f"{FAULT_ENV}: " in line]
    results = [
        (t, json.loads(line.split(" ", 1)[1])) for t, line in lines if line.startswith("RESULT ")
    ]
    assert len(struck) == len(results) == len(expected), text[-4000:]
    waited = []
    for (scenario, start), fault_at, (at, result) in zip(expected, struck, results):
        name = scenario.split(":")[0]
        assert result["scenario"] == scenario and result["raised"]["type"] == "RankLost", result
        message = result["raised"]["message"]
        assert message.startswith(start), message
        assert "\n" not in message and message.count("every rank was stopped") == 1, message
        if name != "async_sgd":  # (its worker 0 trained on, and saved later checkpoints)
            assert message.endswith(CHECKPOINT.format(tmp_path / name)), message
        frozen = "freeze" in scenario
        assert (f"dead_peer_timeout={DEAD_PEER_S:g} s" in message) == frozen, message
        waited.append(at - fault_at)
        assert waited[-1] < (DEAD_PEER_S + 8 if frozen else 8), (scenario, waited)
        assert waited[-1] > (DEAD_PEER_S if frozen else 0), (scenario, waited)
    return waited


def test_a_killed_or_frozen_rank_ends_each_plugins_fork_launch_naming_it(tmp_path):
    run = _run(tmp_path, [s for s, _ in FORK], limit_s=300)
    waited = _check(tmp_path, FORK, run)
    print("seconds from fault to line:", dict(zip((s for s, _ in FORK), waited)))


@pytest.mark.parametrize("scenario, start", POPEN, ids=[s.split(":")[0] for s, _ in POPEN])
def test_a_killed_or_frozen_script_ends_a_popen_launch_naming_it(tmp_path, scenario, start):
    run = _run(tmp_path, [scenario], limit_s=200, LIGHTNING_PAR_START_METHOD="popen")
    waited = _check(tmp_path, [(scenario, start)], run)
    print("seconds from fault to line:", waited)


def test_a_forkserver_launch_with_parameter_servers_leaves_no_folder_and_no_server(tmp_path):
    """No ``pymp-*`` folder (a forkserver's socket) and no forkserver process outlives the
    script: worker 0's servers come from a forkserver of its own, and worker 0 is killed."""
    run = _run(tmp_path, [s for s, _ in FORKSERVER], limit_s=240,
               LIGHTNING_PAR_START_METHOD="forkserver")  # fmt: skip
    waited = _check(tmp_path, FORKSERVER, run)
    print("seconds from fault to line:", waited)


@pytest.mark.parametrize("launch", ["fork", "popen fault_tolerant"])
def test_a_killed_launcher_leaves_no_rank_and_no_temporary_folder(tmp_path, launch):
    """``popen fault_tolerant``: the launcher is rank 0's keeper, which serves the store."""
    from test_interrupts import SCRIPT as TRAINS_SLOWLY
    from test_interrupts import _alive

    script, private_tmp = tmp_path / "train.py", tmp_path / "tmp"
    script.write_text(textwrap.dedent(TRAINS_SLOWLY))
    private_tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "TMPDIR": str(private_tmp),
           "LIGHTNING_PAR_TIMEOUT": "60"}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), *launch.split()], env=env,
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("rank*.pid"))) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "no rank trained"
            time.sleep(0.2)
        ranks = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
        proc.kill()  # the launcher, as the OOM killer would: no `finally` runs in it
        proc.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in ranks if _alive(p)], "ranks outlived their launcher"
        assert [p.name for p in private_tmp.iterdir() if "torchinductor" not in p.name] == []
    finally:
        kill_tree(proc.pid)
