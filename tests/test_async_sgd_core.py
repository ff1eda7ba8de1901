"""Asynchronous SGD on the parameter servers, free of Lightning: s=0 is the synchronous server,
the staleness bound holds with a slow worker, every update's staleness is recorded."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_par.comm import CommTrace, Communicator, run_on_ranks
from lightning_par.paramserver import AsyncParameterClient, ParameterClient, serve, serve_async

PER_WORKER = 4


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 32), nn.Tanh(), nn.Linear(32, 10))


def data(n: int):
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def worker_rank(rank: int, world: int, workers: int, mode: str, staleness, steps: int,
                slow_s: float):  # fmt: skip
    comm = Communicator(trace=CommTrace(rank))
    if rank >= workers:
        if mode == "sync":
            serve(comm, rank - workers)
            return None
        return serve_async(comm, rank - workers, staleness).history
    model, (x, y) = make_model(), data(steps * workers * PER_WORKER)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    cls = ParameterClient if mode == "sync" else AsyncParameterClient
    client = cls(model, opt, comm, workers, world - workers, split_mb=0.004)
    for step in range(steps):
        opt.param_groups[0]["lr"] = 0.1 * 0.5**step  # a schedule on the workers
        lo = (step * workers + rank) * PER_WORKER
        F.cross_entropy(model(x[lo : lo + PER_WORKER]), y[lo : lo + PER_WORKER]).backward()
        client.finish_backward()
        opt.zero_grad()
        if rank == 1:
            time.sleep(slow_s)  # a straggler
    client.close()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
    return weights, list(getattr(client, "updates", []))


@pytest.mark.parametrize("workers,servers", [(2, 1), (3, 2)])
def test_staleness_zero_equals_the_synchronous_server(workers, servers):
    sync = run_on_ranks(worker_rank, workers + servers, workers, "sync", None, 3, 0.0, timeout=60)
    ssp0 = run_on_ranks(worker_rank, workers + servers, workers, "async", 0, 3, 0.0, timeout=60)
    for (w_sync, _), (w_async, updates) in zip(sync[:workers], ssp0[:workers]):
        assert torch.equal(torch.from_numpy(w_async), torch.from_numpy(w_sync))
        assert [(s, lead) for _, s, lead in updates] == [(0, 0)] * 3
    assert not torch.equal(  # it trained
        torch.from_numpy(sync[0][0]),
        torch.cat([p.detach().flatten() for p in make_model().parameters()]),
    )


def test_staleness_bound_holds_with_a_slow_worker():
    workers, steps = 2, 8
    free = run_on_ranks(worker_rank, 3, workers, "async", None, steps, 0.15, timeout=60)
    bounded = run_on_ranks(worker_rank, 3, workers, "async", 1, steps, 0.15, timeout=60)
    for out in (free, bounded):
        history = out[workers]  # the server's record: every push applied and answered once
        assert sorted(w for w, _, _ in history) == [0] * steps + [1] * steps
        for w in range(workers):  # each worker received its own updates' staleness
            assert [s for v, s, _ in history if v == w] == [s for _, s, _ in out[w][1]]
    # unbounded, the fast worker races ahead of the straggler
    assert max(lead for _, _, lead in free[workers]) >= 3
    # s=1: never more than one step ahead; staleness at most (W-1)(2s+1) updates
    assert max(lead for _, _, lead in bounded[workers]) == 1
    assert max(s for _, s, _ in bounded[workers]) <= (workers - 1) * 3
    assert max(s for _, s, _ in free[workers]) > (workers - 1) * 3


def test_fully_asynchronous_applies_every_push():
    workers = 3
    out = run_on_ranks(worker_rank, 4, workers, "async", None, 4, 0.0, timeout=60)
    history = out[workers]
    assert len(history) == 4 * workers  # one server update per push, none averaged away
    assert {s for _, s, _ in history} - {0}  # some updates were computed on stale weights


def test_every_worker_ends_with_the_servers_final_weights():
    out = run_on_ranks(worker_rank, 3, 2, "async", None, 5, 0.05, timeout=60)
    # the slow worker's last pull predates the fast one's updates; close() pulls again
    assert torch.equal(torch.from_numpy(out[0][0]), torch.from_numpy(out[1][0]))
