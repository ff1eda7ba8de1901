"""``fault_tolerant=True`` under the launchers that are not ours: torchrun (one agent, and two
agents as two nodes on 127.0.0.1) and srun (its tasks started here as srun starts them).

torchrun's agent stops every worker as soon as one ends by a signal, so each rank forks
behind a keeper (:mod:`lightning_par.launch.keeper`) that tells the launcher a lost rank
ended well when the job goes on without it; rank 0 too under torchrun, whose agent holds the
store, where the first survivor takes over rank 0's loggers and checkpoints
(:mod:`lightning_par.strategies._leader`). Each run is the user's script
(``_fault_tolerant_script.py``): a rank killed or frozen by ``LIGHTNING_PAR_FAULT``, then
``save_checkpoint`` and ``validate``. It must exit 0 with the keeper's line, end with one
process's weights (or, for local SGD, those of the run without the fault), and leave no
process or temporary file.
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
SCRIPT = HERE / "_fault_tolerant_script.py"
sys.path.insert(0, str(HERE))
from _script_runs import run_script  # noqa: E402
from conformance.launchers import clean_env, free_job_id, run_all, srun_env  # noqa: E402
from test_fault_tolerance import assert_logged_whole, one_process  # noqa: E402

from lightning_par.launch.processes import kill_tree  # noqa: E402
from lightning_par.launch.rendezvous import find_free_port  # noqa: E402

#: torch's own, kept by design: the agent's log folder
AGENT_FILES = ("torchelastic_",)


def _torchrun(tmp_path: Path, name: str, fault: str, variant: str = "tiny", restarts: int = 0):
    """``torchrun --standalone --nproc-per-node=3 --max-restarts=RESTARTS`` of the script."""
    out = tmp_path / "weights.pt"
    cmd = [sys.executable, "-u", "-m", "torch.distributed.run", "--standalone",
           f"--max-restarts={restarts}", "--nproc-per-node=3", str(SCRIPT), name, "3", fault,
           str(out), variant]  # fmt: skip
    run = run_script(cmd, tmp_path, 240, {"LIGHTNING_PAR_TIMEOUT": "90"}, settle_s=5)
    left = [n for n in run.left if not n.startswith(AGENT_FILES)]
    assert run.session == [] and left == [], (run.session, left, run.text[-3000:])
    return run, out


def _result(text: str) -> dict:
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, text[-4000:]  # from the rank that leads, alone
    return json.loads(lines[0][len("RESULT ") :])


def _worst(expected: dict, got: dict) -> float:
    return max((expected[k] - got[k]).abs().max().item() for k in expected)


TORCHRUN = [  # (strategy, fault, the line of the keeper of the lost rank)
    ("ring_allreduce", "kill:rank=1:step=5", "rank 1 was killed by SIGKILL"),
    # (a frozen rank: after rank 0's loss, below)
    ("parameter_server", "kill:rank=2:step=5", "worker 2 (rank 2) was killed by SIGKILL"),
]


@pytest.mark.parametrize("name, fault, line", TORCHRUN, ids=[f"{n}-{f}" for n, f, _ in TORCHRUN])
def test_a_lost_rank_is_survived_under_torchrun(tmp_path, name, fault, line):
    run, out = _torchrun(tmp_path, name, fault)
    assert run.code == 0, run.text[-4000:]
    assert f"lightning_par: {line}; the other ranks go on without it" in run.text, run.text
    assert _result(run.text)["raised"] is None and "Traceback" not in run.text, run.text
    assert _worst(one_process(3), torch.load(out, weights_only=True)) < 1e-5


def test_lost_ranks_are_taken_over_found_and_replaced_under_torchrun(tmp_path):
    """``torchrun --max-restarts=1``, one run for every claim (each has its own lines):

    * rank 0 killed at step 3: the first survivor takes over its loggers and checkpoints
      (every step's row in the CSV file once, rank 0's rows kept; the last checkpoint at
      the last step; the script's validate after fit logged once, from it);
    * rank 2 frozen at step 5: found by a survivor's heartbeat and ended, its keeper
      telling the agent it ended well;
    * each lost rank's keeper starts a replacement, which joins the survivors at a step
      boundary with the training state of a healthy peer (no checkpoint read) and trains
      its place's shard again, taking it back from the survivor that stood in for it.

    The run ends with one process's weights (the ``slow`` variant: 3 epochs of 20 steps of
    a quarter second, so that the replacements join mid-epoch and go on into the next)."""
    fault = "kill:rank=0:step=3,freeze:rank=2:step=5"
    run, out = _torchrun(tmp_path, "ring_allreduce", fault, "slow", restarts=1)
    assert run.code == 0, run.text[-4000:]
    assert "rank(s) 0 lost; 2 of 3 ranks go on (ranks [1, 2])" in run.text, run.text
    assert "rank 2 stopped responding for 2 s" in run.text, run.text[-4000:]
    assert "rank(s) 2 lost; 1 of 2 ranks go on (ranks [1])" in run.text, run.text[-4000:]
    for rank in (0, 2):
        line = (f"rank {rank} was killed by SIGKILL; the other ranks go on without it, and its "
                "replacement starts to join them (0 more restart(s) allowed)")  # fmt: skip
        assert line in run.text, run.text[-4000:]
    joined = re.findall(r"rank (\d)'s replacement joined as rank (\d)", run.text)
    assert sorted(joined) == [("0", "3"), ("2", "4")], run.text[-4000:]
    assert "3 ranks go on (ranks [1, 3, 4])" in run.text, run.text[-4000:]
    result = _result(run.text)
    assert result["raised"] is None and "Traceback" not in run.text, run.text[-4000:]
    assert "will be deleted" not in run.text, run.text
    assert result["members"] == [1, 3, 4]
    assert _worst(one_process(3, "slow"), torch.load(out, weights_only=True)) < 1e-5
    assert_logged_whole(tmp_path, 60)  # (rank 0 wrote steps 0-2 before it was lost)
    # each epoch's validation once (the replacements validate their shards), and the
    # script's validate after fit, from the survivor that leads
    assert [row["step"] for row in _validated(tmp_path)] == ["19", "39", "59", "60"]


def _validated(folder: Path) -> list[dict]:
    """The rows of the script's ``validate`` after ``fit`` in every CSV file of its logs."""
    validated = []
    for metrics in (folder / "logs").rglob("metrics.csv"):
        with open(metrics, newline="") as f:
            validated += [row for row in csv.DictReader(f) if row.get("val_loss")]
    return validated


def test_parameter_server_worker_0_lost_under_torchrun_is_taken_over_by_the_first_survivor(
    tmp_path,
):
    """The servers outlive worker 0 (their starter), worker 1 pushes its gradient of the
    step and trains its batches, and takes over its loggers and checkpoints."""
    run, out = _torchrun(tmp_path, "parameter_server", "kill:rank=0:step=5", "logged")
    assert run.code == 0, run.text[-4000:]
    said = "lightning_par: worker 0 (rank 0) was killed by SIGKILL; the other ranks go on"
    assert run.text.count(said) == 1, run.text[-4000:]
    assert run.text.count("worker 0 (rank 0) lost; worker 1 pushed its gradient") == 1
    assert _result(run.text)["raised"] is None and "Traceback" not in run.text, run.text
    assert _worst(one_process(3), torch.load(out, weights_only=True)) < 1e-5
    assert_logged_whole(tmp_path, 12)
    # the script's validate after fit, in the same processes, logs from the first survivor
    assert len(_validated(tmp_path)) == 1


def test_local_sgd_losing_rank_0_under_torchrun_ends_as_the_run_without_it(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    run, out = _torchrun(tmp_path / "a", "local_sgd", "kill:rank=0:step=5")
    assert run.code == 0 and "Traceback" not in run.text, run.text[-4000:]
    assert "lightning_par: rank 0 was killed by SIGKILL; the other ranks go on" in run.text
    plain, plain_out = _torchrun(tmp_path / "b", "local_sgd", "-")
    assert plain.code == 0, plain.text[-4000:]
    got, expected = (torch.load(p, weights_only=True) for p in (out, plain_out))
    assert _worst(expected, got) < 1e-5


def test_a_lost_rank_on_the_second_node_is_survived_by_two_torchrun_agents(tmp_path):
    """Two agents as two nodes (static rendezvous on 127.0.0.1): ranks 0-1 on the first,
    rank 2 on the second, which is killed; its agent sees its only worker end well."""
    out, port = tmp_path / "weights.pt", find_free_port()
    env = {**_clean_env(), "LIGHTNING_PAR_TIMEOUT": "90"}
    commands = []
    for node, per_node in ((0, 2), (1, 1)):
        cmd = [sys.executable, "-u", "-m", "torch.distributed.run", "--nnodes=2",
               f"--nproc-per-node={per_node}", f"--node-rank={node}",
               "--master-addr=127.0.0.1", f"--master-port={port}", str(SCRIPT),
               "ring_allreduce", "3", "kill:rank=2:step=5", str(out)]  # fmt: skip
        commands.append((cmd, env))
    first, second = run_all(commands, tmp_path, 240)
    assert "lightning_par: rank 2 was killed by SIGKILL; the other ranks go on" in second
    assert "rank(s) 2 lost; 2 of 3 ranks go on (ranks [0, 1])" in first, first[-3000:]
    assert _result(first)["raised"] is None and "Traceback" not in first + second
    assert _worst(one_process(3), torch.load(out, weights_only=True)) < 1e-5


def _clean_env() -> dict[str, str]:
    return {**clean_env(), "PYTHONPATH": str(HERE.parent)}


def _srun(tmp_path: Path, fault: str, variant: str = "tiny", name: str = "ring_allreduce",
          **extra: str) -> tuple[list[int], list[str], Path]:  # fmt: skip
    job, out = free_job_id(), tmp_path / "weights.pt"
    procs = []
    for task in range(3):
        env = {**srun_env(job, task, 1, 3), "LIGHTNING_PAR_TIMEOUT": "90", **extra}
        args = [sys.executable, "-u", str(SCRIPT), name, "3", fault, str(out), variant]
        procs.append(subprocess.Popen(
            args, cwd=tmp_path, env={**env, "PYTHONPATH": str(HERE.parent)},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        ))  # fmt: skip
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            kill_tree(p.pid)
    return [p.returncode for p in procs], outputs, out


def test_a_lost_task_is_survived_under_srun(tmp_path):
    """srun starts every task itself (no launcher of ours): the survivors go on alone, and
    the lost task's keeper ends well, so srun does not end the step."""
    codes, outputs, out = _srun(tmp_path, "kill:rank=1:step=5")
    assert codes == [0, 0, 0], outputs
    assert "lightning_par: rank 1 was killed by SIGKILL; the other ranks go on" in outputs[1]
    assert "rank(s) 1 lost; 2 of 3 ranks go on (ranks [0, 2])" in outputs[0], outputs[0]
    assert "Traceback" not in "".join(outputs), outputs
    assert _worst(one_process(3), torch.load(out, weights_only=True)) < 1e-5


def test_rank_0_lost_under_srun_is_taken_over_a_rank_frozen_later_is_found_and_both_replaced(
    tmp_path,
):
    """Under srun rank 0 would serve the job's store; its keeper serves it instead and
    stays until every task ended, so the first survivor takes over rank 0's share (its
    loggers and checkpoints too). The survivors still watch each other: the keeper, not
    rank 0, served the store, so its end is no store's end. Rank 2 frozen later is found by
    rank 1's heartbeat, and rank 1 goes on alone until, with LIGHTNING_PAR_MAX_RESTARTS=1
    (nothing restarts a task under srun), each lost task's keeper starts a replacement
    that joins it. (One run for every claim: each has its own lines and files.)"""
    fault = "kill:rank=0:step=3,freeze:rank=2:step=5"
    codes, outputs, out = _srun(tmp_path, fault, "slow", LIGHTNING_PAR_MAX_RESTARTS="1")
    assert codes == [0, 0, 0], outputs
    assert "lightning_par: rank 0 was killed by SIGKILL; the other ranks go on" in outputs[0]
    assert "rank(s) 0 lost; 2 of 3 ranks go on (ranks [1, 2])" in outputs[1], outputs[1]
    # found by the heartbeat within dead_peer_timeout, not by a collective's timeout
    assert "rank 2 stopped responding for 2 s" in outputs[1], outputs[1][-3000:]
    assert "rank(s) 2 lost; 1 of 2 ranks go on (ranks [1])" in outputs[1], outputs[1][-3000:]
    joined = re.findall(r"rank (\d)'s replacement joined as rank (\d)", outputs[1])
    assert sorted(joined) == [("0", "3"), ("2", "4")], outputs[1][-3000:]
    result = _result(outputs[1])  # (now the leader)
    assert result["raised"] is None and result["members"] == [1, 3, 4], outputs[1][-3000:]
    assert "Traceback" not in "".join(outputs) and "TCPStore" not in "".join(outputs), outputs
    assert _worst(one_process(3, "slow"), torch.load(out, weights_only=True)) < 1e-5
    assert_logged_whole(tmp_path, 60)


def test_parameter_server_worker_0_lost_under_srun_is_taken_over_by_the_first_survivor(
    tmp_path,
):
    """Worker 0's keeper serves the job's store instead of it; the servers outlive it and
    worker 1 takes over its share (its batches, loggers and checkpoints)."""
    codes, outputs, out = _srun(tmp_path, "kill:rank=0:step=5", "logged", "parameter_server")
    assert codes == [0, 0, 0], outputs
    said = "lightning_par: worker 0 (rank 0) was killed by SIGKILL; the other ranks go on"
    assert said in outputs[0], outputs[0]
    assert "worker 0 (rank 0) lost; worker 1 pushed its gradient" in outputs[1], outputs[1]
    assert "Traceback" not in "".join(outputs), outputs
    assert _result(outputs[1])["raised"] is None, outputs[1]
    assert _worst(one_process(3), torch.load(out, weights_only=True)) < 1e-5
    assert_logged_whole(tmp_path, 12)


def test_a_new_trainer_for_a_later_fit_trains_as_one_process_or_is_refused_after_a_loss(
    tmp_path,
):
    """A script that builds a new Trainer and strategy for its second fit: the ranks leave
    the first fit's group (whose store counted its steps) and meet in a new one, and the
    weights are one process's after both fits. After a rank was lost in the first fit, the
    second Trainer, which expects every rank, is refused with a line naming the fix."""
    (whole := tmp_path / "whole").mkdir()
    run, out = _torchrun(whole, "ring_allreduce", "-", "two_trainers")
    assert run.code == 0 and _result(run.text)["raised"] is None, run.text[-4000:]
    assert _worst(one_process(3, "two_trainers"), torch.load(out, weights_only=True)) < 1e-5
    (lost := tmp_path / "lost").mkdir()
    run, _ = _torchrun(lost, "ring_allreduce", "kill:rank=2:step=3", "two_trainers")
    raised = _result(run.text)["raised"]
    assert raised is not None and raised["fit"] == 1, run.text[-4000:]
    assert (
        "an earlier fault-tolerant fit of this script went on without the ranks it lost"
        in (raised["message"])
    ), raised
