"""The Lightning-free parameter server: sharding plan, exactness, bytes per server link."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_par.comm import CommTrace, Communicator, run_on_ranks
from lightning_par.paramserver import ParameterClient, plan_shards, serve

STEPS, PER_WORKER = 3, 4


# ---- the plan -------------------------------------------------------------------------------
def test_plan_balances_bytes_and_splits_big_tensors():
    numels = [1000, 10, 300, 300, 10, 5000]
    plan = plan_shards(numels, [4] * 6, num_servers=2, split_bytes=4 * 2000)
    # the 5000-element tensor is cut in two halves, one per server
    assert [(p.start, p.stop, p.server) for p in plan.of_param(5)] == [
        (0, 2500, 0),
        (2500, 5000, 1),
    ]
    # every element of every tensor is held exactly once
    for i, n in enumerate(numels):
        covered = sorted((p.start, p.stop) for p in plan.of_param(i))
        assert covered[0][0] == 0 and covered[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    loads = plan.server_bytes()
    assert sum(loads) == 4 * sum(numels)
    assert max(loads) - min(loads) <= 4 * 1000  # within the largest unsplit tensor


def test_plan_one_server_holds_everything_whole():
    plan = plan_shards([7, 9], [4, 4], num_servers=1, split_bytes=0)
    assert [(p.param, p.start, p.stop, p.server) for p in plan.pieces] == [
        (0, 0, 7, 0),
        (1, 0, 9, 0),
    ]


def test_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_servers"):
        plan_shards([1], [4], 0)
    with pytest.raises(ValueError, match="one entry"):
        plan_shards([1, 2], [4], 1)


# ---- training -------------------------------------------------------------------------------
def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 32),
        nn.Tanh(), nn.Linear(32, 10),
    )  # fmt: skip


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    return torch.optim.Adam(model.parameters(), lr=0.01)


def batches(num_workers: int):
    g = torch.Generator().manual_seed(7)
    n = STEPS * num_workers * PER_WORKER
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def lr_at(step: int, base: float) -> float:
    return base * 0.5**step  # a schedule run on the workers


def one_process(num_workers: int, kind: str) -> torch.Tensor:
    model, (x, y) = make_model(), batches(num_workers)
    opt = make_optimizer(model, kind)
    base = opt.param_groups[0]["lr"]
    size = num_workers * PER_WORKER
    for step in range(STEPS):
        opt.param_groups[0]["lr"] = lr_at(step, base)
        F.cross_entropy(
            model(x[step * size : (step + 1) * size]), y[step * size : (step + 1) * size]
        ).backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def ps_rank(rank: int, world: int, num_workers: int, kind: str):
    comm = Communicator(trace=CommTrace(rank))
    if rank >= num_workers:
        serve(comm, rank - num_workers)
        return [m for m in comm.trace.messages if m.tag in ("push", "pull")]
    model, (x, y) = make_model(), batches(num_workers)
    opt = make_optimizer(model, kind)
    base = opt.param_groups[0]["lr"]
    client = ParameterClient(model, opt, comm, num_workers, world - num_workers,
                             bucket_cap_mb=0.002, split_mb=0.004)  # fmt: skip
    size = num_workers * PER_WORKER
    for step in range(STEPS):
        opt.param_groups[0]["lr"] = lr_at(step, base)
        lo = step * size + rank * PER_WORKER
        F.cross_entropy(model(x[lo : lo + PER_WORKER]), y[lo : lo + PER_WORKER]).backward()
        client.finish_backward()
        opt.zero_grad()
    client.close()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # numpy, not a tensor: a tensor would travel as shared memory freed when the rank exits
    weights = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
    return weights, nbytes, client.plan


@pytest.mark.parametrize(
    "workers,servers,kind", [(2, 1, "sgd"), (3, 2, "sgd"), (2, 2, "adam"), (3, 1, "adam")]
)
def test_weights_equal_one_process_and_bytes_equal_cost_model(workers, servers, kind):
    out = run_on_ranks(ps_rank, workers + servers, workers, kind, timeout=60)
    expected = one_process(workers, kind)
    for weights, _, _ in out[:workers]:
        torch.testing.assert_close(torch.from_numpy(weights), expected, atol=2e-6, rtol=1e-5)
    _, n, plan = out[0]
    shard_bytes = plan.server_bytes()
    assert sum(shard_bytes) == n
    for s in range(servers):
        messages = out[workers + s]
        pieces = len(plan.of_server(s))  # one float32 flag per slice rides with each push
        received = sum(m.nbytes for m in messages if m.op == "recv" and m.tag == "push")
        sent = sum(m.nbytes for m in messages if m.op == "send" and m.tag == "pull")
        assert sent == STEPS * workers * shard_bytes[s]
        assert received == STEPS * workers * (shard_bytes[s] + 4 * pieces)
        if servers > 1:  # sharded: each link carries about 1/S of the model
            assert abs(shard_bytes[s] - n / servers) <= 0.2 * n / servers
