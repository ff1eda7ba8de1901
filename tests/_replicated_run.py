"""Replicated parameter servers without Lightning, in processes of one gloo group: two
workers train on ``servers`` shards with their copies (``fault_tolerant``), while a server
dies at a chosen point of the protocol (:func:`_arm`) or a worker as it pushes
(:func:`_lose_worker`); :func:`run_replicated` returns every worker's weights and the
optimiser state gathered from the servers, and :func:`assert_same` compares two runs
(``test_paramserver_replication.py``)."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_par.comm import Communicator
from lightning_par.launch.lost import how_it_ended
from lightning_par.launch.policy import limit_threads_after_fork, plan_launch
from lightning_par.launch.rendezvous import find_free_port
from lightning_par.paramserver import faults
from lightning_par.paramserver.clipping import GradClip
from lightning_par.paramserver.faults import LOST_KEY
from lightning_par.paramserver.protocol import NONE
from lightning_par.paramserver.replicated_client import ReplicatedClient
from lightning_par.paramserver.replication import Backup, Replica, server_processes
from lightning_par.paramserver.server import ShardOptimizer
from lightning_par.paramserver.shard_server import ShardServer, serve_replicated

WORKERS, STEPS, BATCH = 2, 5, 4
TIMEOUT = timedelta(seconds=30)
#: requests: 0 the initial weights, 1-2 steps 0-1, 3 a checkpoint's read and 4 its load,
#: 5-7 steps 2-4 (step = request - 3), 8 the last read, 9 the stop
READ_AT_STEP = 2


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str, request: int) -> None:
    """In a server process: die at ``point`` of ``request``: before its backup has the
    ``initial`` weights; as it ``begin``s; once its backup
    acknowledged its first ``update``; after its ``answer`` went to worker 0 only; as the
    ``copy`` of another shard, after applying that request's first update, before the ack."""
    if point == "initial":  # before its backup got the initial weights
        Backup.initial = lambda self: _die()
    elif point == "begin":
        serve = ShardServer.serve_request
        ShardServer.serve_request = lambda self, h, n, a: (
            (n == request and _die()) or serve(self, h, n, a)
        )
    elif point == "update":
        update = Backup.update

        def updated(self, bucket, grad, used):
            update(self, bucket, grad, used)
            if self.record_count == request:
                _die()

        Backup.update = updated
    elif point == "answer":  # (requests 5-7 are steps 2-4)
        send = ShardOptimizer.send_slices

        def send_slices(self, comm, bucket, workers, step):
            if step != request - 3:
                return send(self, comm, bucket, workers, step)
            send(self, comm, bucket, [0], step)[0].wait()
            if bucket == self.active[-1]:
                _die()
            return []

        ShardOptimizer.send_slices = send_slices
    elif point == "copy":
        ack = Replica._ack
        Replica._ack = lambda self, b: (
            (self.done + 1 == request and b != NONE and _die()) or ack(self, b)
        )


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


def _loss(model: nn.Module, data: tuple, step: int, worker: int) -> torch.Tensor:
    (x, y), lo = data, (step * WORKERS + worker) * BATCH
    return F.cross_entropy(model(x[lo : lo + BATCH]), y[lo : lo + BATCH])


def _lose_worker(point: str, at: int, worker: int = 1) -> None:
    """In the worker lost (``worker``): die at step ``at``, once its second bucket's push
    went (``mid-push``) or once every push went (``pushed``)."""
    push = ReplicatedClient._push

    def pushed(self, bucket):
        push(self, bucket)
        if self.step == at and bucket.index == (
            1 if point == "mid-push" else len(self.buckets.buckets) - 1
        ):
            _die()

    ReplicatedClient._push = pushed


def _train(comm: Communicator, rank: int, servers: int, clip: GradClip | None, lose: tuple | None):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    lost = [lose[2] if len(lose) > 2 else 1] if lose is not None else []
    if rank in lost:
        _lose_worker(*lose)
    client = ReplicatedClient(model, opt, comm, WORKERS, servers, bucket_cap_mb=1e-4,
                              split_mb=2e-4, clip=clip)  # fmt: skip
    g, n = torch.Generator().manual_seed(1), STEPS * WORKERS * BATCH
    data = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
    params = list(model.parameters())
    client.missing.fill = lambda step, lost: {  # the leader pushes a lost worker's gradient
        w: list(torch.autograd.grad(_loss(model, data, step, w), params, allow_unused=True))
        for w in lost
    }  # fmt: skip
    for step in range(STEPS):
        # a checkpoint's read, and loading it (as a resume would); after a loss too (the
        # leader sends the state: worker 1 if worker 0 was lost)
        if step == READ_AT_STEP or (lost and step == STEPS - 1):
            client.load_state(client.gather_state())  # (complete everywhere; the leader sends it)
        client.settle()  # (a lost worker is known from here; the strategy settles there too)
        loss = _loss(model, data, step, rank)
        if client.lost_workers:  # and trains its batches beside its own, pushed in its slot
            client.missing.keep(step, client.missing.fill(step, client.lost_workers))
        loss.backward()
        client.finish_backward()
        opt.zero_grad()
    state = client.gather_state()  # (which reads the last step's answers)
    assert client.lost_workers == lost, client.lost_workers
    client.close()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
    return weights, {k: {n: v.numpy() if torch.is_tensor(v) else v for n, v in s.items()}
                     for k, s in state["state"].items()}  # fmt: skip


def _rank(rank, world, port, servers, kills, clip, lose, queue, threads) -> None:
    limit_threads_after_fork(threads)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
        faults._store = lambda: store  # where the parent says which server died
        if rank >= WORKERS:
            for server, point, request in kills:
                if server == rank - WORKERS:
                    _arm(point, request)
            serve_replicated(Communicator(), rank - WORKERS, world - WORKERS, store, TIMEOUT)
        else:
            queue.put((rank, pickle.dumps(_train(Communicator(), rank, servers, clip, lose))))
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, traceback.format_exc()))
    os._exit(0)


def run_replicated(
    servers: int, *kills: tuple, clip: GradClip | None = None, lose: tuple | None = None
):
    """Train on two workers and ``servers`` shards; each kill: ``(server, point, request)``;
    ``lose``: a worker dies (:func:`_lose_worker`). The parent plays the worker that
    started the servers: it says which one died."""
    workers = WORKERS - (lose is not None)
    world = WORKERS + server_processes(servers, True)
    port = find_free_port()
    plan = plan_launch("cpu", world, can_exec=False)
    ctx = mp.get_context(plan.method)
    queue = ctx.SimpleQueue()
    args = (world, port, servers, kills, clip, lose, queue, plan.threads_per_rank or 1)
    procs = [ctx.Process(target=_rank, args=(r, *args), daemon=True) for r in range(world)]
    for proc in procs:
        proc.start()
    # (the store's server thread starts after the forks: a fork copies no thread's locks)
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=TIMEOUT)  # fmt: skip
    results, said, deadline = {}, set(), time.monotonic() + 90
    try:
        while len(results) < workers and time.monotonic() < deadline:
            while not queue.empty():
                rank, result = queue.get()  # (an error: its traceback)
                assert rank < WORKERS, f"server {rank - WORKERS} failed:\n{result}"
                results[rank] = pickle.loads(result) if isinstance(result, bytes) else result
            for r, proc in enumerate(procs[WORKERS:]):
                if r not in said and proc.exitcode not in (None, 0):
                    store.set(LOST_KEY.format(r), how_it_ended(proc.exitcode))
                    said.add(r)
            time.sleep(0.05)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        del store
    assert len(results) == workers, "the workers did not finish"
    assert not [p for p in procs if p.is_alive()]
    return results, said


def assert_same(run, reference) -> None:
    (results, _), (expected, _) = run, reference
    assert all(isinstance(r, tuple) for r in results.values()), results
    for w in results:  # (every worker, or the one left: run_replicated counts them)
        torch.testing.assert_close(torch.from_numpy(results[w][0]),
                                   torch.from_numpy(expected[w][0]), atol=1e-6, rtol=0)  # fmt: skip
    first = min(results)  # (every worker reads the whole optimiser state)
    for key, state in expected[0][1].items():
        for name, value in state.items():
            got = results[first][1][key][name]
            assert (got == value).all() if hasattr(value, "shape") else got == value, name
