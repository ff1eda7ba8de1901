"""``fault_tolerant=True``: a synchronous data-parallel run goes on without a lost rank and
ends with one process's weights.

The agreements (:mod:`lightning_par.launch.membership`) are tested in one process over a
real store; the product as users run it: ``python _fault_tolerant_script.py`` in a
subprocess (Lightning chooses the launch, or ``popen`` is asked for), a rank killed or
frozen at a step by ``LIGHTNING_PAR_FAULT``, then ``save_checkpoint`` and ``validate`` as
users call them. Each run's weights are compared with one process on the whole batch,
computed here by hand.
"""

from __future__ import annotations

import csv
import json
import re
import sys
import threading
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lightning_par.components.fault_tolerance import FaultTolerance
from lightning_par.launch.membership import COMMIT, PREFIX, REDO, Excluded, Membership
from lightning_par.launch.store_host import StoreHost

HERE = Path(__file__).parent
SCRIPT = HERE / "_fault_tolerant_script.py"
sys.path.insert(0, str(HERE))
from _fault_tolerant_script import DEAD_PEER_S, VARIANTS, Tiny, data  # noqa: E402
from _script_runs import run_script as run_user_script  # noqa: E402


# ---- the agreements, in one process --------------------------------------------------------
def _members(n: int, host: StoreHost) -> list[Membership]:
    def client() -> dist.Store:
        store = dist.TCPStore("127.0.0.1", host.port, is_master=False, wait_for_workers=False)
        return dist.PrefixStore("test", store)

    return [Membership(client(), r, list(range(n)), limit_s=10.0) for r in range(n)]


def _together(calls: list) -> list:
    results: list = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except Exception as err:  # (compared below)
            results[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_members_commit_a_step_together_and_redo_it_when_one_is_lost():
    host = StoreHost()
    try:
        a, b, c = _members(3, host)
        assert _together([partial(m.settle, 0) for m in (a, b, c)]) == [COMMIT] * 3
        assert c.declare_dead(2) is True and a.declare_dead(2) is False  # one says so
        assert _together([partial(m.settle, 1) for m in (a, b)]) == [REDO] * 2
        assert _together([a.regroup, b.regroup]) == [[0, 1], [0, 1]]
        assert (a.rank, b.rank, a.lost, a.generation) == (0, 1, [2], 1)
        with pytest.raises(Excluded, match="rank 2 was found dead"):
            c.regroup()  # thawed after the others went on
        assert _together([partial(m.settle, 1) for m in (a, b)]) == [COMMIT] * 2
    finally:
        host.close()


def test_survivors_read_one_outcome_when_a_member_died_after_counting_in():
    host = StoreHost()
    try:
        a, b, c = _members(3, host)
        c.store.add(f"{PREFIX}/0/step/5/in", 1)  # c finished its exchange, then died
        c.declare_dead(2)
        outcomes = _together([lambda: a.settle(5), lambda: b.settle(5)])
        assert outcomes[0] == outcomes[1] and outcomes[0] in (COMMIT, REDO), outcomes
    finally:
        host.close()


def test_lost_shards_go_round_robin_to_the_survivors_and_the_loss_is_rescaled():
    tolerance = FaultTolerance()
    tolerance.fit_members = [0, 1, 2, 3, 4]
    tolerance.membership = SimpleNamespace(members=[0, 2, 3], me=2, lost=[1, 4], rank=1, places={})
    assert tolerance.lost == [1, 4]
    assert tolerance.stands_in_for() == [4]  # 1 -> survivor 0, 4 -> survivor 2
    tolerance.membership.me, tolerance.membership.rank = 0, 0
    assert tolerance.stands_in_for() == [1]
    assert tolerance.loss_scale == pytest.approx(3 / 5)
    first = {"num_replicas": 5, "rank": 0}
    assert tolerance.sampler_kwargs(first) == {"num_replicas": 3, "rank": 0}


# ---- the product: a script, a fault, one process's weights ---------------------------------
def one_process(world: int, variant: str = "tiny", threads: int = 1, saved_by: int = 0
                ) -> dict[str, torch.Tensor]:  # fmt: skip
    """One process on the union of the ranks' batches (Lightning's DistributedSampler
    shuffles with seed ``epoch``: rank r's batch s is ``order[r::world]`` cut in batches),
    each rank's part run as a forward of its own, as the ranks do: BatchNorm's statistics
    are those of a rank's batch, bf16's gradients are summed in fp32 per rank, and the
    running statistics are those of rank ``saved_by``'s own batches (every rank keeps its
    own buffers and the weights saved are rank 0's, as under Lightning's DDP, or the first
    survivor's once rank 0 is lost). ``threads``: each rank's, so that the kernels sum in
    the same order."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _one_process(world, variant, saved_by)
    finally:
        torch.set_num_threads(before)


def _one_process(world: int, variant: str, saved_by: int = 0) -> dict[str, torch.Tensor]:
    setting = VARIANTS[variant]
    torch.manual_seed(0)
    model = Tiny(variant)
    x, y = data(variant).tensors
    batch = setting.batch
    per_epoch = setting.samples // (world * batch)
    for _ in range(setting.fits):  # (each a new Trainer: its optimiser and epochs anew)
        optimizers, schedulers = _optimizers(model.configure_optimizers())
        for step in range(setting.steps):
            epoch, at = divmod(step, per_epoch)
            seed = torch.Generator().manual_seed(epoch)
            order = torch.randperm(setting.samples, generator=seed)
            idx = order[at * world * batch : (at + 1) * world * batch]
            optimizers[0].zero_grad()
            sum(_rank_loss(model, setting, x[idx[r::world]], y[idx[r::world]], world,
                           r == saved_by) for r in range(world)).backward()  # fmt: skip
            optimizers[0].step()
            for scheduler, interval in schedulers:
                if interval == "step" or at == per_epoch - 1:
                    scheduler.step()
    return model.state_dict()


def _optimizers(configured) -> tuple[list, list[tuple]]:
    """``configure_optimizers``' optimiser and its schedulers with their intervals."""
    if isinstance(configured, torch.optim.Optimizer):
        return [configured], []
    optimizers, schedulers = configured
    found = [(s["scheduler"], s["interval"]) if isinstance(s, dict) else (s, "epoch")
             for s in schedulers]  # fmt: skip
    return optimizers, found


def _rank_loss(model, setting, x, y, world: int, own_buffers: bool) -> torch.Tensor:
    """One rank's share of the mean loss (``own_buffers``: its running statistics kept;
    otherwise the forward updates copies, dropped after it)."""
    owners = [(m, n, b) for m in model.modules() for n, b in m.named_buffers(recurse=False)]
    if not own_buffers:
        for module, name, buffer in owners:
            setattr(module, name, buffer.clone())
    with torch.autocast("cpu", torch.bfloat16, enabled=setting.precision == "bf16-mixed"):
        loss = torch.nn.functional.cross_entropy(model(x), y) / world
    for module, name, buffer in owners:
        setattr(module, name, buffer)
    return loss


def run_script(
    tmp_path: Path, name: str, world: int, fault: str, variant: str = "tiny", **env: str
) -> SimpleNamespace:
    """The script's output lines with their arrival times, its exit code, what it left."""
    out = tmp_path / "weights.pt"
    # (popen's scripts import torch again: on a loaded 2-core machine that can take 20 s)
    run = run_user_script(
        [sys.executable, "-u", str(SCRIPT), name, str(world), fault, str(out), variant],
        tmp_path, 240, {"LIGHTNING_PAR_TIMEOUT": "90", **env},
    )  # fmt: skip
    return SimpleNamespace(code=run.code, lines=run.lines, left=run.left, session=run.session,
                           out=out)  # fmt: skip


def _at(run, text: str) -> float:
    return next(t for t, line in run.lines if text in line)


SURVIVED = [  # (strategy, ranks, fault, launch, what the script switches on)
    # rank 1's shard is trained by rank 0, whose BatchNorm statistics stay its own batches'
    ("ring_allreduce", 3, "kill:rank=1:step=5", "fork", "batchnorm"),
    ("ring_allreduce", 3, "freeze:rank=2:step=7", "fork", "tiny"),
    ("butterfly_allreduce", 4, "kill:rank=3:step=0", "fork", "tiny"),
    ("ring_allreduce", 3, "kill:rank=2:step=9", "popen", "tiny"),
    # rank 0: the first survivor takes over its loggers and checkpoints, and sends the results,
    # and the running statistics saved are its own batches' (rank 0's died with it)
    ("ring_allreduce", 3, "kill:rank=0:step=5", "fork", "batchnorm_logged"),
]


@pytest.mark.parametrize("name, world, fault, launch, variant", SURVIVED, ids=["-".join(
    (n, str(w), *f.split(":")[:2], la, v)) for n, w, f, la, v in SURVIVED])  # fmt: skip
def test_a_lost_rank_is_survived_with_one_process_weights(
    tmp_path, name, world, fault, launch, variant
):
    env = {"LIGHTNING_PAR_START_METHOD": launch} if launch != "fork" else {}
    run = run_script(tmp_path, name, world, fault, variant, **env)
    text = "".join(line for _, line in run.lines)
    lost = fault.split(":")[1].split("=")[1]
    survivors = [r for r in range(world) if str(r) != lost]
    assert text.count(f"rank(s) {lost} lost; {world - 1} of {world} ranks go on") == 1, text
    assert f"(ranks {survivors})" in text, text
    frozen = fault.startswith("freeze")
    assert ("it is ended and the others go on without it" in text) == frozen, text
    detect_s = _at(run, "ranks go on") - _at(run, "LIGHTNING_PAR_FAULT: ")
    assert detect_s < (DEAD_PEER_S + 8 if frozen else 8), detect_s
    worst = _assert_one_process(run, world, variant, saved_by=survivors[0])
    if VARIANTS[variant].logged:
        assert_logged_whole(tmp_path, VARIANTS[variant].steps)
    print(f"{name} p={world} {fault} {launch} {variant}: the survivors went on {detect_s:.2f} "
          f"s after it; weights within {worst:.1e} of one process")  # fmt: skip


def _assert_one_process(run, world: int, variant: str = "tiny", saved_by: int = 0) -> float:
    """The script ended normally with one process's weights (the largest difference is
    returned; buffers: rank ``saved_by``'s own), and its ``validate`` after the loss saw
    every sample (over the survivors)."""
    text = "".join(line for _, line in run.lines)
    assert run.code == 0, text[-4000:]
    assert "Traceback" not in text and "Error" not in text.replace("UserWarning", ""), text[-4000:]
    assert run.session == [] and run.left == [], (run.session, run.left)
    result = json.loads(next(line for _, line in run.lines if line.startswith("RESULT "))[7:])
    assert result["raised"] is None, result
    # the ranks' threads, where the launcher says (popen's rows: small nets, any will do)
    said = re.search(r"(\d+) thread\(s\) per rank", text)
    threads = int(said.group(1)) if said else 1
    expected = one_process(world, variant, threads, saved_by)
    got = torch.load(run.out, weights_only=True)
    worst = max((expected[k] - got[k]).abs().max().item() for k in expected)
    assert worst < 1e-5, {k: (expected[k] - got[k]).abs().max().item() for k in expected}
    x, y = data(variant).tensors  # validate after the loss: every sample, over the survivors
    model, batch = Tiny(variant), VARIANTS[variant].batch
    model.load_state_dict(expected)
    bf16 = VARIANTS[variant].precision == "bf16-mixed"
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        losses = [
            torch.nn.functional.cross_entropy(model.eval()(x[i : i + batch]), y[i : i + batch])
            for i in range(0, len(x), batch)
        ]  # (as validate: batch by batch, in eval mode)
    whole = torch.stack(losses).mean().item()
    # relative too: a torchvision net's running statistics after a few steps are far from a
    # batch's, so its loss is large and float32's last bits pass 1e-5 (the weights stay 1e-5)
    assert result["val_loss"] == pytest.approx(whole, rel=1e-5, abs=1e-5)
    return worst


def assert_logged_whole(folder: Path, steps: int) -> None:
    """A run of the ``logged`` variant that lost rank 0 kept its logs and checkpoints whole:
    every step's row in the CSV file once (rank 0's rows kept), the last checkpoint at the
    last step, the script's own checkpoint written."""
    logged = []  # (a fork launch's validate after fit logs in a version of its own)
    for metrics in (folder / "logs").rglob("metrics.csv"):
        with open(metrics, newline="") as f:
            logged += [int(row["step"]) for row in csv.DictReader(f) if row.get("train_loss")]
    assert logged == list(range(steps)), logged
    (last,) = (folder / "logs").rglob("last.ckpt")
    assert torch.load(last, weights_only=False)["global_step"] == steps
    assert (folder / "final.ckpt").is_file()


def test_rank_0_lost_under_popen_is_survived_behind_the_scripts_keeper(tmp_path):
    """Under popen the user's script keeps rank 0 (a run of the script of its own) and the
    job's store: rank 0 killed, the survivors go on and run what follows ``fit``, the first
    one taking over rank 0's share (its weights, and its loggers and checkpoints: the
    ``logged`` variant is ``tiny`` with a CSV logger and a checkpoint callback, so one run
    checks both), and the script ends well once they did, naming rank 0 in one line."""
    variant = "logged"
    run = run_script(tmp_path, "ring_allreduce", 3, "kill:rank=0:step=4", variant,
                     LIGHTNING_PAR_START_METHOD="popen")  # fmt: skip
    text = "".join(line for _, line in run.lines)
    assert text.count("rank(s) 0 lost; 2 of 3 ranks go on") == 1, text
    assert "(ranks [1, 2])" in text, text
    named = "lightning_par: rank 0 was killed by SIGKILL; the other ranks go on without it"
    assert text.count(named) == 1, text
    _assert_one_process(run, 3, variant)
    assert text.count("RESULT ") == 1, text  # (the first survivor: global zero)
    assert_logged_whole(tmp_path, VARIANTS[variant].steps)


# ---- the lost ranks' batches, read again -------------------------------------------------------
def test_a_lost_ranks_batch_is_read_again_from_lightnings_sampler_and_from_device_batches():
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from lightning_par.data.device import DeviceBatches
    from lightning_par.strategies._stand_ins import LostShards, StandInError

    dataset = TensorDataset(torch.arange(60.0).view(60, 1))

    def loader(rank: int) -> DataLoader:
        sampler = DistributedSampler(dataset, num_replicas=3, rank=rank, shuffle=True, seed=4)
        sampler.set_epoch(2)
        return DataLoader(dataset, batch_size=4, sampler=sampler)

    lost_rank_batches = list(loader(1))
    shards = LostShards()
    for idx in (3, 4, 0):  # from where the loss struck, then the next epoch's first
        (got,) = shards.batches(loader(0), [1], idx)
        assert torch.equal(got[0], lost_rank_batches[idx][0])
    images = torch.randint(0, 255, (48, 3, 8, 8), dtype=torch.uint8)
    labels = torch.arange(48)
    own, lost = (DeviceBatches(images, labels, 4, r, 3, augment=True, seed=1) for r in (0, 2))
    expected = list(lost)  # what rank 2 would have trained in epoch 0
    next(iter(own))  # rank 0 is in epoch 0
    (got,) = LostShards().batches(own, [2], 2)
    assert torch.equal(got[0], expected[2][0]) and torch.equal(got[1], expected[2][1])
    with pytest.raises(StandInError, match="DistributedSampler"):
        LostShards().batches(DataLoader(dataset, batch_size=4), [1], 0)


def test_a_strategy_with_or_without_fault_tolerance_travels_to_spawned_ranks():
    import pickle

    from lightning_par.strategies import AllReduceStrategy

    for enabled in (False, True):
        copy = pickle.loads(pickle.dumps(AllReduceStrategy("ring", fault_tolerant=enabled)))
        assert copy.resilience.enabled is enabled and copy.resilience.tolerance.membership is None
