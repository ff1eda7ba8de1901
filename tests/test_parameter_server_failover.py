"""A parameter server lost mid-run with ``fault_tolerant=True`` (``LIGHTNING_PAR_FAULT`` kills
or freezes it as a step begins): a user's plain script in a fresh interpreter, Lightning
choosing the launch (fork here, popen when asked), ends normally; its weights equal those of
a run in which no server was lost; one line on stderr names the lost server and says the job
went on; no process and no temporary file is left. A lost worker is survived too (the
fault grid of ``tests/test_fault_tolerance_ps.py`` runs one against one process's weights)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
from _script_runs import run_script

from lightning_par.launch.faults import FAULT_ENV

HERE = Path(__file__).parent
SCRIPT = HERE / "_ps_failover_script.py"
DEAD_PEER_S = 2.0  # the script's dead_peer_timeout
WORKERS = 2
#: the line of a server taken over by its copy
TOOK_OVER = (r"lightning_par: parameter server {lost} \(rank {rank}\) (was killed by SIGKILL|"
             r"stopped responding for .*its starter killed it).*; parameter server {by} "
             r"\(rank \d+\) took over its shard .* and the job went on")  # fmt: skip


def _run(tmp_path: Path, args: list[str], limit_s: float, **env: str):
    """Run the script; its exit code, stderr's lines with the time each arrived, what is
    left in its session (a server's last exit is asynchronous: 5 s for it) and its temporary
    folder."""
    run = run_script(
        [sys.executable, "-u", str(SCRIPT), str(tmp_path), *args], tmp_path, limit_s, env,
        stderr_only=True, settle_s=5,
    )  # fmt: skip
    return run.code, run.lines, run.session, run.left


def _check(tmp_path: Path, scenarios: list[str], run) -> list[float]:
    """Every scenario's weights and line; the seconds from each fault to its line."""
    code, lines, session, left = run
    text = "".join(line for _, line in lines)
    assert code == 0, text[-4000:]
    assert "Traceback" not in text and "Error" not in text, text[-4000:]
    assert session == [] and left == [], (session, left)
    reference = torch.load(tmp_path / "0.pt")
    starts = [i for i, (_, line) in enumerate(lines) if line.startswith("SCENARIO ")]
    assert len(starts) == len(scenarios), text[-4000:]
    waited = []
    for i, scenario in enumerate(scenarios[1:], start=1):
        own = lines[starts[i] : starts[i + 1] if i + 1 < len(starts) else len(lines)]
        weights = torch.load(tmp_path / f"{i}.pt")
        for name, value in reference.items():
            torch.testing.assert_close(weights[name], value, atol=1e-6, rtol=0, msg=scenario)
        servers, fault = scenario.split(":", 1)
        lost = int(re.search(r"server=(\d)", fault).group(1))
        by = (lost + 1) % max(2, int(servers))
        struck = [t for t, line in own if f"{FAULT_ENV}: parameter server {lost} " in line]
        pattern = TOOK_OVER.format(lost=lost, rank=WORKERS + lost, by=by)
        said = [t for t, line in own if re.fullmatch(pattern, line.strip())]
        assert len(struck) == 1 and len(said) == 1, (scenario, text[-4000:])
        waited.append(said[0] - struck[0])
        frozen = fault.startswith("freeze")
        assert (DEAD_PEER_S if frozen else 0) < waited[-1] < (DEAD_PEER_S if frozen else 0) + 8
    losses = [line for _, line in lines if line.startswith("lightning_par: parameter server ")]
    assert len(losses) == len(scenarios) - 1, losses  # one line per lost server, no more
    return waited


def test_a_lost_server_is_taken_over_exactly_in_a_fork_launch(tmp_path):
    scenarios = ["2:none", "2:kill:server=1:step=3", "1:kill:server=0:step=3",
                 "2:freeze:server=0:step=2"]  # fmt: skip
    run = _run(tmp_path, ["--clip", *scenarios], limit_s=240)
    waited = _check(tmp_path, scenarios, run)
    print("seconds from fault to the takeover's line:", dict(zip(scenarios[1:], waited)))


def test_a_lost_server_is_taken_over_exactly_in_a_popen_launch(tmp_path):
    scenarios = ["2:none", "2:kill:server=0:step=3", "1:kill:server=0:step=5"]
    run = _run(tmp_path, scenarios, limit_s=240, LIGHTNING_PAR_START_METHOD="popen")
    waited = _check(tmp_path, scenarios, run)
    print("seconds from fault to the takeover's line:", dict(zip(scenarios[1:], waited)))


#: the lines of a lost worker: the launcher's, and worker 0's as it takes its place
LOST_WORKER = (
    r"lightning_par: worker 1 \(rank 1\) was killed by SIGKILL; the other workers go on without it"
)
IN_ITS_PLACE = (r"lightning_par: worker 1 \(rank 1\) lost; worker 0 pushed its gradient of step "
                r"\d+ in its place and trains its batches from now on .*")  # fmt: skip


def test_a_lost_worker_is_survived_exactly_beside_lost_servers_and_clipping(tmp_path):
    """fault_tolerant=True also survives a lost worker (killed, or frozen at the first step),
    with clipping by norm over two servers, and a worker and a server killed in the same
    step (the server's copy takes over, answering worker 0 alone; a lone server's standby,
    or the other of two): the weights equal the plain parameter server's, each loss is said
    in two lines, and no process or temporary file is left."""
    scenarios = ["2:none", "2:kill:rank=1:step=3", "1:freeze:rank=1:step=0",
                 "2:kill:rank=1:step=3,kill:server=1:step=3",
                 "1:kill:rank=1:step=5,kill:server=0:step=5"]  # fmt: skip
    code, lines, session, left = _run(tmp_path, ["--clip", *scenarios], limit_s=240)
    text = "".join(line for _, line in lines)
    assert code == 0, text[-4000:]
    assert "Traceback" not in text and "Error" not in text, text[-4000:]
    assert session == [] and left == [], (session, left)
    reference = torch.load(tmp_path / "0.pt")
    for i, scenario in enumerate(scenarios[1:], start=1):
        weights = torch.load(tmp_path / f"{i}.pt")
        for name, value in reference.items():
            torch.testing.assert_close(weights[name], value, atol=1e-6, rtol=0, msg=scenario)
    # (searched, not matched whole: a line of another process may be written inside one)
    for pattern in (LOST_WORKER, IN_ITS_PLACE):
        said = [t for t, line in lines if re.search(pattern, line)]
        assert len(said) == len(scenarios) - 1, (pattern, text[-4000:])
    took_over = [(s, by) for s, by in ((1, 0), (0, 1)) if re.search(
        TOOK_OVER.format(lost=s, rank=WORKERS + s, by=by), text)]  # fmt: skip
    assert took_over == [(1, 0), (0, 1)], text[-4000:]
    struck = [t for t, line in lines if f"{FAULT_ENV}: rank 1 " in line]
    said = [t for t, line in lines if re.search(LOST_WORKER, line)]
    waited = [b - a for a, b in zip(struck, said)]
    assert waited[0] < 8 and DEAD_PEER_S < waited[1] < DEAD_PEER_S + 8, waited
    print("seconds from the fault to the launcher's line:", dict(zip(scenarios[1:], waited)))
