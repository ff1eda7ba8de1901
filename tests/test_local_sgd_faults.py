"""``local_sgd(fault_tolerant=True)``: a run that loses a rank between two averagings ends
with the weights of the same run without the fault.

The replication pieces (:mod:`lightning_par.components.replica_ring`) are tested without
Lightning: who trains a lost replica, a state's bytes, a stand-in trained inside another
replica's module exactly as in a module of its own, and the mean over ranks that train
several replicas. The product as users run it: ``python _local_sgd_fault_script.py`` in a
subprocess (Lightning chooses the launch, or ``popen`` is asked for), a rank killed in the
middle of a period or as the step that ends one begins, compared with the same script run
without a fault.
"""

from __future__ import annotations

import copy
import json
import pickle
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from _script_runs import run_script as run_user_script
from torch import nn

from lightning_par.collectives import ring_allreduce
from lightning_par.collectives.averaging import replica_mean
from lightning_par.comm import Communicator, run_on_ranks
from lightning_par.components.replica_ring import (
    ReplicaLayout,
    ReplicaLost,
    ReplicaState,
    StandIn,
    decode_states,
    encode_states,
    next_hosts,
    pass_right,
    random_state,
)
from lightning_par.launch.faults import FAULT_ENV
from lightning_par.strategies.local_sgd import LocalSGDStrategy

HERE = Path(__file__).parent
SCRIPT = HERE / "_local_sgd_fault_script.py"
DEAD_PEER_S = 2.0  # the script's dead_peer_timeout


# ---- the pieces, without Lightning -------------------------------------------------------------
def test_a_lost_members_replicas_go_to_its_right_neighbour_which_holds_their_state():
    first = {m: [m] for m in range(4)}
    assert next_hosts(first, [0, 1, 2, 3], [0, 2, 3]) == {0: [0], 2: [1, 2], 3: [3]}
    assert next_hosts(first, [0, 1, 2, 3], [0, 1, 2]) == {0: [0, 3], 1: [1], 2: [2]}
    assert next_hosts(first, [0, 1, 2, 3], [0, 2]) == {0: [0, 3], 2: [1, 2]}
    # after an averaging with rank 2 training replicas 1 and 2: both go to rank 3
    later = {0: [0], 2: [1, 2], 3: [3]}
    assert next_hosts(later, [0, 2, 3], [0, 3]) == {0: [0], 3: [1, 2, 3]}
    with pytest.raises(ReplicaLost, match=r"ranks 1 and 2 were both lost .* replica\(s\) \[1\]"):
        next_hosts(first, [0, 1, 2, 3], [0, 3])  # rank 2 held rank 1's state


def _adam_state() -> dict:
    net = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(net.parameters(), lr=0.1)
    net(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return optimizer.state_dict()


def test_replica_states_travel_as_tensors_and_numbers_and_a_pickle_is_refused():
    state = ReplicaState(_adam_state(), [torch.tensor([7])], random_state(torch.device("cpu")))
    back = decode_states(encode_states({1: state, 2: ReplicaState({}, [], None)}))
    assert sorted(back) == [1, 2] and back[2].random is None
    assert torch.equal(back[1].kept[0], state.kept[0])
    assert torch.equal(back[1].random["cpu"], state.random["cpu"])
    moments = back[1].optimizer["state"][0]["exp_avg"]
    assert torch.equal(moments, state.optimizer["state"][0]["exp_avg"])
    hostile = pickle.dumps(SimpleNamespace(run="code"), protocol=2)  # any object at all
    with pytest.raises(pickle.UnpicklingError):
        decode_states(torch.frombuffer(bytearray(hostile), dtype=torch.uint8))


class _Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.BatchNorm1d(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).square().mean()


def _own_run(module: _Dropped, optimizer, batches, rng: torch.Tensor) -> None:
    torch.set_rng_state(rng)
    for x in batches:
        optimizer.zero_grad()
        module(x).backward()
        optimizer.step()


@pytest.mark.parametrize("own_stream", [True, False], ids=["own-stream", "host-stream"])
def test_a_stand_in_trains_in_the_hosts_module_as_in_a_module_of_its_own(own_stream):
    """Replica B trained inside A's module (storage swapped, its own Adam, its own random
    stream or the host's) equals B trained alone, and A's own steps (with an LR scheduler
    patching its optimiser) are untouched by B's."""
    torch.manual_seed(0)
    a, b = _Dropped(), _Dropped()
    batches = [torch.randn(5, 6) for _ in range(4)]
    start = torch.get_rng_state()
    opt_a = torch.optim.Adam(a.parameters(), lr=0.05)
    opt_b = torch.optim.Adam(b.parameters(), lr=0.02)
    _own_run(b, opt_b, batches[:1], start)  # B has an Adam state before it is handed over
    state_b = ReplicaState(copy.deepcopy(opt_b.state_dict()), [], None)
    weights_b = [t.detach().clone() for t in [*b.parameters(), *b.buffers()]]
    alone_a, alone_b = copy.deepcopy((a, b))
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, 1, 0.5)  # sets opt_a.step on the instance
    ref_a = torch.optim.Adam(alone_a.parameters(), lr=0.05)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_a, 1, 0.5)
    ref_b = torch.optim.Adam(alone_b.parameters(), lr=0.02)
    ref_b.load_state_dict(copy.deepcopy(state_b.optimizer))  # (load keeps its tensors)

    layout = ReplicaLayout(a, list(a.parameters()))  # buffers kept, not averaged
    base = layout.pick(weights_b, layout.averaged)
    state_b.kept = layout.pick(weights_b, layout.kept)
    b_stream = torch.Generator().manual_seed(1).get_state()
    state_b.random = {"cpu": b_stream} if own_stream else None
    stand_in = StandIn.build(1, layout, base, state_b, opt_a)
    cpu = torch.device("cpu")
    torch.set_rng_state(start)
    for x in batches[1:]:
        step_start = random_state(cpu)
        opt_a.zero_grad()
        a(x).backward()
        opt_a.step()
        sched_a.step()
        with stand_in.installed(layout.tensors, step_start, cpu):
            for group in stand_in.optimizer.param_groups:
                group["lr"] = 0.02
            stand_in.optimizer.zero_grad()
            a(x).backward()
            stand_in.optimizer.step()

    torch.set_rng_state(start)  # A alone draws what A drew with B inside it
    for x in batches[1:]:
        ref_a.zero_grad()
        alone_a(x).backward()
        ref_a.step()
        ref_sched.step()
    # B alone: its own stream, or at each step the state A's step began with (the same
    # stream, since A drew the same amount per step)
    _own_run(alone_b, ref_b, batches[1:], b_stream if own_stream else start)
    for got, want in zip(layout.tensors, [*alone_a.parameters(), *alone_a.buffers()]):
        assert torch.equal(got, want)
    for got, want in zip(stand_in.tensors, [*alone_b.parameters(), *alone_b.buffers()]):
        assert torch.equal(got, want)
    assert not torch.equal(stand_in.tensors[0], weights_b[0])  # B trained
    assert stand_in.optimizer.state_dict()["state"][0]["step"] == 4  # its own Adam state
    assert opt_a.state_dict()["state"][0]["step"] == 3 and opt_a.param_groups[0]["lr"] < 0.05


def _means_and_neighbours(rank: int, world_size: int) -> dict:
    torch.manual_seed(rank)
    replicas = [[torch.randn(5), torch.randn(2, 3).double()] for _ in range(rank + 1)]
    before = copy.deepcopy(replicas)
    means = replica_mean(replicas, 6, ring_allreduce, Communicator())
    got = pass_right(Communicator(), torch.tensor([10 + rank], dtype=torch.uint8))
    return {"means": means, "untouched": all(
        torch.equal(x, y) for r, s in zip(replicas, before) for x, y in zip(r, s)
    ), "from_left": int(got.item())}  # fmt: skip


def test_ranks_training_several_replicas_average_them_all_and_pass_states_right():
    results = run_on_ranks(_means_and_neighbours, 3, timeout=60)
    everyone = []
    for rank in range(3):
        torch.manual_seed(rank)
        everyone += [[torch.randn(5), torch.randn(2, 3).double()] for _ in range(rank + 1)]
    expected = [sum(r[i] for r in everyone) / 6 for i in range(2)]
    for rank, out in enumerate(results):
        assert out["untouched"] and out["from_left"] == 10 + (rank - 1) % 3
        for got, want in zip(out["means"], expected):
            assert got.dtype == want.dtype and torch.allclose(got, want, atol=1e-6)


def test_what_a_stand_in_cannot_train_exactly_is_refused_before_launch():
    strategy = LocalSGDStrategy(fault_tolerant=True)
    strategy._precision_plugin = SimpleNamespace(scaler=object())  # "16-mixed" on a GPU
    refused = r"local_sgd\(fault_tolerant=True\) .* precision='16-mixed'"
    with pytest.raises(ValueError, match=refused):
        strategy.replicas.check_before_launch()
    trainer = pl.Trainer(
        strategy=LocalSGDStrategy(fault_tolerant=True), accelerator="cpu", devices=2,
        accumulate_grad_batches=2, logger=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"local_sgd\(fault_tolerant=True\) cannot accumulate"):
        trainer.strategy.check_before_launch(trainer)
    with pytest.raises(TypeError, match="fault_tolerant must be True or False"):
        LocalSGDStrategy(fault_tolerant="yes")


# ---- the product: a script, a fault, the weights of the run without it -------------------------
def run_script(folder: Path, period: int, fault: str, *extra: str, **env: str) -> SimpleNamespace:
    """The script's output lines with their arrival times, its exit code, what it left."""
    folder.mkdir()
    out = folder / "weights.pt"
    # (a popen rank imports torch and Lightning before it joins: on a loaded 2-core machine
    # that may take longer than the suite's 20 s group timeout)
    run = run_user_script(
        [sys.executable, "-u", str(SCRIPT), "3", str(period), fault, str(out), *extra],
        folder, 150, {"LIGHTNING_PAR_TIMEOUT": "60", **env},
    )  # fmt: skip
    result = [json.loads(line[7:]) for _, line in run.lines if line.startswith("RESULT ")]
    return SimpleNamespace(
        code=run.code, lines=run.lines, text=run.text, left=run.left, session=run.session,
        out=out, result=result[0] if result else None,
    )  # fmt: skip


@pytest.fixture(scope="module")
def without_fault(tmp_path_factory):
    """The script without a fault, once per period (fork: popen gives the same weights)."""
    runs: dict[int, SimpleNamespace] = {}

    def run(period: int) -> SimpleNamespace:
        if period not in runs:
            runs[period] = run_script(tmp_path_factory.mktemp("ref") / "run", period, "-")
            assert runs[period].code == 0, runs[period].text[-4000:]
        return runs[period]

    return run


#: torch's warning (with its C++ frames) when a store client of a popen rank's heartbeat
#: or regroup watcher is still asking as the job's store host closes at the job's end: a
#: shutdown race of the launcher (the allreduce strategies' popen runs show it as often)
STORE_CLOSED = re.compile(
    r"^(\[rank\d+\]:\[W.*TCPStore\.cpp.*|Exception raised from (recv|send)Bytes.*|frame #\d+: .*"
    r"|<omitting python frames>)$", re.M,
)  # fmt: skip


def _at(run: SimpleNamespace, text: str) -> float:
    return next(t for t, line in run.lines if text in line)


LOST = [  # fault, launch, period, extra, host, steps replayed
    ("kill:rank=1:step=5", "fork", 4, "", 2, 4),  # mid-period: steps 4-7 replayed by rank 2
    ("kill:rank=2:step=7", "fork", 4, "", 0, 4),  # as the step ending a period begins
    ("kill:rank=2:step=9", "popen", 4, "", 0, 4),  # rank 2's right neighbour is rank 0
    # rank 0, the script's own run behind its keeper: the survivors go on and end the script
    ("kill:rank=0:step=5", "popen", 4, "", 1, 4),
    ("kill:rank=1:step=11", "fork", 5, "", 2, 2),  # found by the last averaging, at fit's end
    ("freeze:rank=2:step=6", "fork", 4, "", 0, 4),  # silent: ended after dead_peer_timeout
    ("kill:rank=2:step=5", "fork", 4, "sync", 0, 2),  # found by step 5's sync_dist: 4, 5
]


@pytest.mark.parametrize(
    "fault, launch, period, extra, host, replayed", LOST,
    ids=["-".join([*f.split(":"), la, f"period{p}", *e.split()]) for f, la, p, e, _, _ in LOST],
)  # fmt: skip
def test_a_rank_lost_mid_period_leaves_the_weights_of_the_run_without_it(
    tmp_path, without_fault, fault, launch, period, extra, host, replayed
):
    reference = without_fault(period)
    env = {"LIGHTNING_PAR_START_METHOD": launch} if launch != "fork" else {}
    run = run_script(tmp_path / "run", period, fault, *extra.split(), **env)
    text = run.text
    assert run.code == 0, text[-4000:]
    errors = STORE_CLOSED.sub("", text).replace("UserWarning", "")
    assert "Traceback" not in text and "Error" not in errors, text
    assert run.session == [] and run.left == [], (run.session, run.left)
    lost = int(fault.split(":")[1].split("=")[1])
    survivors = [r for r in range(3) if r != lost]
    # (rank 0 under popen: its keeper says so, as under torchrun, of the other "ranks")
    assert f"rank {lost} was killed by SIGKILL; the other workers go on without it" in text or (
        lost == 0 and "rank 0 was killed by SIGKILL; the other ranks go on without it" in text
    ), text
    frozen = fault.startswith("freeze")
    assert (f"rank {lost} stopped responding for" in text) == frozen, text
    assert (
        text.count(
            f"rank(s) {lost} lost; 2 of 3 ranks go on (ranks {survivors}), each lost "
            "replica is rebuilt by the next rank and the averaging is run again"
        )
        == 1
    )
    took_over = re.findall(
        rf"local_sgd: rank {host} trains rank {lost}'s replica too, rebuilt as of the last "
        rf"averaging \({replayed} step\(s\) since replayed in ([0-9.]+) s\)", text,
    )  # fmt: skip
    assert len(took_over) == 1, text
    expected = torch.load(reference.out, weights_only=True)
    got = torch.load(run.out, weights_only=True)
    assert max((expected[k] - got[k]).abs().max().item() for k in expected) < 1e-6
    assert run.result["val_loss"] == pytest.approx(reference.result["val_loss"], abs=1e-6)
    found_s = _at(run, "ranks go on") - _at(run, f"{FAULT_ENV}: ")  # (the next collective)
    assert found_s < (DEAD_PEER_S + 8 if frozen else 8), found_s  # (a period is ~0.3 s here)
    extra_s = run.result["fit_s"] - reference.result["fit_s"]
    print(
        f"{fault} {launch} period {period} {extra}: found {found_s:.2f} s after the fault, "
        f"replay {took_over[0]} s, fit {extra_s:+.2f} s against no fault"
    )
