"""The hooks both parameter-server strategies hand to their ServerGroup are ordinary methods
of one named base, :class:`~lightning_par.strategies._server_group.ServerGroupStrategy`,
which neither strategy redefines; the ServerGroup takes what it uses, not the strategy."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from lightning_par.components.server_group import ServerGroup
from lightning_par.components.worker_context import WorkerContext
from lightning_par.strategies._base import ParStrategy
from lightning_par.strategies._server_group import ServerGroupStrategy
from lightning_par.strategies.async_sgd import AsyncSGDStrategy
from lightning_par.strategies.parameter_server import ParameterServerStrategy

HOOKS = ("broadcast", "optimizer_step", "validation_step", "optimizer_state", "teardown")


@pytest.mark.parametrize("cls", [ParameterServerStrategy, AsyncSGDStrategy])
def test_the_shared_hooks_are_the_bases_and_marked_override(cls) -> None:
    assert cls.__bases__ == (ServerGroupStrategy,)
    assert ServerGroupStrategy.__bases__ == (ParStrategy,)
    for name in HOOKS:
        hook = vars(ServerGroupStrategy)[name]
        assert hook.__override__ and getattr(cls, name) is hook  # inherited, not a copy


def test_evaluating_waits_for_every_pulled_layer_first(monkeypatch) -> None:
    calls = []

    def step(self, *args, **kwargs):
        calls.append("step")
        return "out"

    monkeypatch.setattr(ParStrategy, "validation_step", step)
    strategy = ParameterServerStrategy()
    monkeypatch.setattr(strategy.servers, "settle", lambda: calls.append("settle"))
    assert strategy.validation_step(1) == "out" and calls == ["settle", "step"]


def test_the_servers_serve_one_optimiser() -> None:
    strategy = AsyncSGDStrategy()
    weight = torch.nn.Parameter(torch.zeros(1))
    strategy.optimizers = [torch.optim.SGD([weight], lr=0.1) for _ in range(2)]
    with pytest.raises(ValueError, match="async_sgd runs one optimiser; .* returned 2"):
        strategy.connect_servers({})


def _context(workers: int = 2) -> WorkerContext:
    return WorkerContext(
        strategy_name="parameter_server", workers=workers, rank=0, local_rank=0, node_rank=0,
        num_nodes=1, timeout=timedelta(seconds=5), group_store=lambda: (None, None),
        outlives_the_call=True,
    )  # fmt: skip


def test_a_server_group_names_ranks_by_its_context() -> None:
    context = _context(workers=2)
    assert context.rank_name(1) == "worker 1 (rank 1)"
    assert context.rank_name(2) == "parameter server 0 (rank 2)"


def test_a_step_without_a_loss_is_refused_in_the_strategys_name() -> None:
    servers = ServerGroup(num_servers=1, bucket_cap_mb=1.0, split_mb=1.0)
    servers.context = _context()
    with pytest.raises(RuntimeError, match="parameter_server: training_step returned None"):
        servers.step(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1),
                     lambda: None, module=None, precision=None)  # fmt: skip
