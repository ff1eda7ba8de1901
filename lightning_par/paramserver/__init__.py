"""A synchronous, sharded parameter server, free of Lightning.

* :mod:`~lightning_par.paramserver.plan`: which server holds which parameter slices;
* :mod:`~lightning_par.paramserver.messages`: what workers and servers send each other;
* :mod:`~lightning_par.paramserver.server`: the update rule and the serve loop;
* :mod:`~lightning_par.paramserver.worker`: push per bucket during backward, pull per layer
  before forward.
"""

from lightning_par.paramserver.plan import Piece, ShardPlan, plan_shards
from lightning_par.paramserver.server import ShardOptimizer, serve, synchronous_step
from lightning_par.paramserver.worker import ParameterClient, check_optimizer

__all__ = [
    "ParameterClient",
    "Piece",
    "ShardOptimizer",
    "ShardPlan",
    "check_optimizer",
    "plan_shards",
    "serve",
    "synchronous_step",
]
