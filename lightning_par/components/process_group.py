"""The process group of a strategy's ranks: met in the job's store, watched for dead peers,
destroyed before the interpreter's own shutdown.

What :meth:`~lightning_par.strategies._base.ParStrategy.setup_distributed` does after
Lightning has set the ranks: ``torch.distributed.init_process_group`` over the store this
project's launcher holds for the job (:mod:`lightning_par.launch.rendezvous`: no other job
can take it), with the strategy's ``timeout`` (one unit from the constructor to the socket),
then a heartbeat (:mod:`lightning_par.launch.liveness`) that reports a dead peer within
seconds while a live one may take up to that timeout.
"""

from __future__ import annotations

import atexit
import os
from typing import Any

import torch.distributed as dist

from lightning_par.launch import liveness
from lightning_par.launch.rendezvous import StoreAddress, group_store, wait_until_connected


def strategy_store(host: Any) -> tuple[Any, StoreAddress]:
    """The store the next process group of strategy ``host`` meets in: the one this
    project's launcher holds, else the cluster's (``srun`` sets no ``MASTER_PORT``:
    Lightning's ``SLURMEnvironment`` derives it from the job id)."""
    env = host.cluster_environment
    main = None if env is None else (env.main_address, env.main_port)
    return group_store(host.global_rank, host.timeout, host.store_spec, main)


def join_process_group(host: Any, backend: str) -> Any | None:
    """Join (or, after ``fit``, go on watching) the group of ``host``'s ranks; the store it
    met in when it joined now (None: it had joined before)."""
    if dist.is_initialized():
        earlier = host.process_group_store is None  # (an earlier Trainer's strategy made it)
        if earlier and dist.get_world_size() != host.world_size:
            raise RuntimeError(
                f"lightning_par: {host.strategy_name} runs on {host.world_size} ranks, but "
                f"this process's group has {dist.get_world_size()}: an earlier fault-tolerant "
                "fit of this script went on without the ranks it lost. Go on with that fit's "
                "Trainer (its validate, test or fit again), or start the job again from its "
                "last checkpoint with every rank"
            )
        if liveness.current() is not None:
            liveness.current().resume()  # fit, then test: the same group, watched again
        return None
    env = host.cluster_environment
    assert env is not None
    os.environ["MASTER_ADDR"] = env.main_address
    os.environ["MASTER_PORT"] = str(env.main_port)
    store, _ = host.group_store()
    kwargs: dict[str, Any] = {"timeout": host.timeout, "store": store}
    if host.root_device.type != "cpu":
        kwargs["device_id"] = host.root_device
    dist.init_process_group(backend, rank=host.global_rank, world_size=host.world_size, **kwargs)
    # Destroy the group before the interpreter's own shutdown: a gloo group still alive then
    # can abort the process ("terminate called without an active exception"), as Lightning
    # already guards against for NCCL.
    atexit.register(destroy_process_group)
    liveness.watch_group(
        store, host.global_rank, host.watched_ranks(), host.timeout, host.rank_name,
        host.dead_peer_timeout,
    )  # fmt: skip
    wait_until_connected(backend)
    return store


def destroy_process_group() -> None:
    """Stop watching the peers and destroy the group, if there is one."""
    liveness.stop_watching()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
