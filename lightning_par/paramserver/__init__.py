"""Sharded parameter servers, synchronous and asynchronous, free of Lightning.

* :mod:`~lightning_par.paramserver.protocol`: every command, message kind (gloo tag) and
  the encoder and decoder of every kind (header, init, push, pull, info, work, norm, state,
  stop), in one place (:mod:`~lightning_par.paramserver.wire`: objects without pickle);
* :mod:`~lightning_par.paramserver.plan`: which server holds which parameter slices;
* :mod:`~lightning_par.paramserver.spec`: what a server knows of the model and optimiser;
* :mod:`~lightning_par.paramserver.messages`: the exchanges of several messages (headers to
  every server, objects, squared norms) over a Communicator;
* :mod:`~lightning_par.paramserver.server`: the update rule and the synchronous serve loop;
* :mod:`~lightning_par.paramserver.clipping`: gradient clipping over sharded gradients (by
  norm: the servers exchange their shards' squared norms);
* :mod:`~lightning_par.paramserver.client_plan` (what a worker sends where, a pure function)
  and :mod:`~lightning_par.paramserver.links` (the pushes and pulls that move it), shared by
  :mod:`~lightning_par.paramserver.worker` (synchronous: push per bucket during backward,
  pull per layer before forward) and :mod:`~lightning_par.paramserver.async_client`;
* :mod:`~lightning_par.paramserver.asynchronous`: the asynchronous (stale synchronous)
  server; :mod:`~lightning_par.paramserver.work`: batches handed out on demand;
* ``fault_tolerant``: :mod:`~lightning_par.paramserver.replication` (each shard copied in the
  next server process, after every update), :mod:`~lightning_par.paramserver.takeover` (a
  lost server's shard answered from its copy, the interrupted request exactly once),
  :mod:`~lightning_par.paramserver.shard_server` (the servers' side) and
  :mod:`~lightning_par.paramserver.replicated_client` (the workers', its messages moved by
  :mod:`~lightning_par.paramserver.replicated_links`).
"""

from lightning_par.paramserver.async_client import AsyncParameterClient
from lightning_par.paramserver.asynchronous import AsyncServer, serve_async
from lightning_par.paramserver.client_plan import ClientPlan, plan_client
from lightning_par.paramserver.clipping import GradClip
from lightning_par.paramserver.plan import Piece, ShardPlan, plan_shards
from lightning_par.paramserver.protocol import Command, Header, Kind, ProtocolError
from lightning_par.paramserver.remedies import Remedies
from lightning_par.paramserver.replicated_client import ReplicatedClient
from lightning_par.paramserver.server import ShardOptimizer, serve, synchronous_step
from lightning_par.paramserver.shard_server import serve_replicated
from lightning_par.paramserver.spec import ServerSpec, check_optimizer
from lightning_par.paramserver.worker import ParameterClient

__all__ = [
    "AsyncParameterClient",
    "AsyncServer",
    "ClientPlan",
    "Command",
    "GradClip",
    "Header",
    "Kind",
    "ParameterClient",
    "Piece",
    "ProtocolError",
    "Remedies",
    "ReplicatedClient",
    "ServerSpec",
    "ShardOptimizer",
    "ShardPlan",
    "check_optimizer",
    "plan_client",
    "plan_shards",
    "serve",
    "serve_async",
    "serve_replicated",
    "synchronous_step",
]
