"""The workers' group kept between two calls of a server strategy's script: complete on every
worker before any worker goes on, since the next call may end it at once.

A full run under two torchrun agents on a loaded machine saw it: worker 1 still completed its
side of gloo's rendezvous when the others, already done, ended the group for the next call;
worker 1 read "Connection closed by peer" and the job failed.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from lightning_par.components import workers_between_calls
from lightning_par.components.worker_context import WorkerContext
from lightning_par.launch import run_on_ranks

#: how long worker 1 is still busy with the group after its rendezvous returned
LATE_S = 2.0


def _keep_then_end(rank: int, world_size: int) -> tuple[float, float]:
    store = dist.PrefixStore("kept", dist.distributed_c10d._get_default_store())
    dist.destroy_process_group()  # (the call's group of workers and servers has ended)
    context = WorkerContext(
        strategy_name="parameter_server", workers=world_size, rank=rank, local_rank=rank,
        node_rank=0, num_nodes=1, timeout=dist.default_pg_timeout,
        group_store=lambda: (store, None), outlives_the_call=True,
    )  # fmt: skip
    ready, real = time.time(), dist.init_process_group
    if rank == 1:  # worker 1 completes its side of the rendezvous late

        def late(*args, **kwargs):
            nonlocal ready
            real(*args, **kwargs)
            time.sleep(LATE_S)
            ready = time.time()

        dist.init_process_group = late
    try:
        workers_between_calls.keep_workers_group(context, None, list(range(world_size)))
    finally:
        dist.init_process_group = real
    went_on = time.time()
    workers_between_calls.end_kept_group()  # the next call ends the kept group at once
    return ready, went_on


def test_no_worker_goes_on_before_every_worker_has_the_kept_group():
    (_, first_went_on), (late_ready, _) = run_on_ranks(_keep_then_end, 2, timeout=30)
    assert first_went_on >= late_ready, (
        f"worker 0 went on {late_ready - first_went_on:.1f} s before worker 1 had the group: "
        "ending it then breaks worker 1's rendezvous"
    )
