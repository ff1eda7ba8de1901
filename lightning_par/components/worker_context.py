"""What a :class:`~lightning_par.components.server_group.ServerGroup` needs of the worker
it runs in: the strategy's name, where the worker stands, how long to wait, and where a new
process group meets. The strategy gives it once the ranks are known
(``setup_distributed``), so the group never reads its strategy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from lightning_par.launch.rendezvous import StoreAddress
from lightning_par.paramserver import process as servers


@dataclass(frozen=True)
class WorkerContext:
    """Where a worker stands, for the server group it holds.

    Args:
        strategy_name: the strategy, as error messages name it.
        workers: ``W``, the training processes (the servers are ranks ``W .. W+S-1``).
        rank, local_rank, node_rank, num_nodes: where this worker stands among this call's
            workers (after a loss, local rank 0 is the first survivor on its node).
        timeout: how long a collective or a receive may wait.
        group_store: a new ``(store, address)`` for each process group the workers join.
        outlives_the_call: the user's script goes on in this rank after ``fit`` (popen,
            torchrun, SLURM), rather than in a process that forked it.
        dead_peer_s: how long a rank may stop responding (None: the default).
    """

    strategy_name: str
    workers: int
    rank: int
    local_rank: int
    node_rank: int
    num_nodes: int
    timeout: timedelta
    group_store: Callable[[], tuple[Any, StoreAddress]]
    outlives_the_call: bool
    dead_peer_s: float | None = None

    def rank_name(self, rank: int) -> str:
        """How reports name group rank ``rank`` (a worker or a server)."""
        return servers.role_name(self.workers, rank)
