"""Allreduce collectives built from point-to-point messages (no Lightning needed).

Each function sums a tensor in place across the ranks of a process group, like
``torch.distributed.all_reduce(t, op=SUM)``, using only sends and receives through
:class:`lightning_par.comm.Communicator` (so every message can be traced):

* :func:`ring_allreduce` - reduce-scatter + all-gather, bandwidth-optimal;
* :func:`tree_allreduce` - reduce up a binary tree, broadcast down;
* :func:`butterfly_allreduce` - recursive doubling, fewest steps;
* :func:`round_robin_allreduce` - every rank in turn reduces one chunk (a master per chunk);
* :func:`all_to_all_allreduce`, :func:`master_worker_allreduce` - teaching baselines.

The ring's two phases are collectives of their own (:mod:`.ring_phases`, for sharded data
parallelism): :func:`ring_reduce_scatter` leaves rank ``r`` with the sum of chunk ``r``,
:func:`ring_all_gather` gives every rank every rank's chunk. They are not allreduces, so
not in :data:`ALGORITHMS`.

:func:`average_parameters` averages a model's weights with any of them (local SGD).

:mod:`~lightning_par.collectives.cost_model` predicts their bytes, messages and time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_par.collectives.averaging import average_parameters, broadcast_parameters
from lightning_par.collectives.baselines import all_to_all_allreduce, master_worker_allreduce
from lightning_par.collectives.butterfly import butterfly_allreduce
from lightning_par.collectives.cost_model import Cost, fit_alpha_beta, predict
from lightning_par.collectives.ring import ring_allreduce
from lightning_par.collectives.ring_phases import ring_all_gather, ring_reduce_scatter
from lightning_par.collectives.round_robin import round_robin_allreduce
from lightning_par.collectives.tree import tree_allreduce, tree_broadcast

#: Algorithm name -> collective; the names used by strategies, benchmarks and the cost model.
ALGORITHMS: dict[str, Callable[..., torch.Tensor]] = {
    "ring": ring_allreduce,
    "tree": tree_allreduce,
    "butterfly": butterfly_allreduce,
    "all_to_all": all_to_all_allreduce,
    "master_worker": master_worker_allreduce,
    "round_robin": round_robin_allreduce,
}

#: Algorithm name -> one line for listings (the strategy registry, the CLI, the check).
DESCRIPTIONS: dict[str, str] = {
    "ring": "Ring allreduce (reduce-scatter + all-gather)",
    "tree": "Tree allreduce (reduce to rank 0, broadcast back)",
    "butterfly": "Butterfly allreduce (recursive doubling)",
    "all_to_all": "All-to-all allreduce (teaching baseline)",
    "master_worker": "Master-worker allreduce (teaching baseline)",
    "round_robin": "Round-robin allreduce (each rank in turn reduces its own chunk)",
}


def get_allreduce(algorithm: str) -> Callable[..., torch.Tensor]:
    """The collective named ``algorithm`` (a key of :data:`ALGORITHMS`)."""
    try:
        return ALGORITHMS[algorithm]
    except KeyError:
        raise ValueError(
            f"unknown allreduce algorithm {algorithm!r}; choose one of {sorted(ALGORITHMS)}"
        ) from None


__all__ = [
    "ALGORITHMS",
    "DESCRIPTIONS",
    "Cost",
    "all_to_all_allreduce",
    "average_parameters",
    "broadcast_parameters",
    "butterfly_allreduce",
    "fit_alpha_beta",
    "get_allreduce",
    "master_worker_allreduce",
    "predict",
    "ring_all_gather",
    "ring_allreduce",
    "ring_reduce_scatter",
    "round_robin_allreduce",
    "tree_allreduce",
    "tree_broadcast",
]
