"""The hooks both parameter-server strategies hand to their ServerGroup are written once
(:mod:`lightning_par.strategies._ps_hooks`) and installed on each class, without a class
between the strategies and ParStrategy."""

from __future__ import annotations

import pytest

from lightning_par.strategies._base import ParStrategy
from lightning_par.strategies._ps_hooks import server_group_hooks
from lightning_par.strategies.async_sgd import AsyncSGDStrategy
from lightning_par.strategies.parameter_server import ParameterServerStrategy

HOOKS = ("broadcast", "optimizer_step", "validation_step", "optimizer_state", "teardown")


@pytest.mark.parametrize("cls", [ParameterServerStrategy, AsyncSGDStrategy])
def test_the_installed_hooks_are_the_classes_own_and_marked_override(cls) -> None:
    assert cls.__bases__ == (ParStrategy,)
    for name in HOOKS:
        hook = vars(cls)[name]
        assert hook.__override__ and hook.__qualname__ == f"{cls.__name__}.{name}"
    # the same body in both, not a copy
    assert ParameterServerStrategy.teardown.__code__ is AsyncSGDStrategy.teardown.__code__


def test_a_hook_the_strategy_writes_itself_is_not_overwritten() -> None:
    class Own(ParStrategy):
        def teardown(self) -> None:
            pass

    with pytest.raises(TypeError, match="Own.teardown is installed by server_group_hooks"):
        server_group_hooks(Own)


def test_super_in_an_installed_hook_is_the_next_class_of_its_strategy() -> None:
    calls = []

    class Base(ParStrategy):
        def validation_step(self, *args, **kwargs):
            calls.append("base")
            return "out"

    @server_group_hooks
    class Strategy(Base):
        pass

    class Servers:
        def settle(self) -> None:
            calls.append("settle")

    strategy = Strategy.__new__(Strategy)
    strategy.servers = Servers()
    assert strategy.validation_step(1) == "out" and calls == ["settle", "base"]
