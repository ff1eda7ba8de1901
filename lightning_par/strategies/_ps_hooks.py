"""The Lightning hooks that hand off to a
:class:`~lightning_par.components.server_group.ServerGroup`, written once for
``parameter_server`` and ``async_sgd``.

Both strategies are *a server group + these Lightning hooks*; most hooks are the same one
line in both (Lightning's collectives among the workers, the step through the servers,
checkpoints from the servers, the goodbye). A mixin class would hold them once but add a
class between the strategies and :class:`~lightning_par.strategies._base.ParStrategy`
(ARCHITECTURE.md: at most two of our classes above Lightning's), so
:func:`server_group_hooks` *installs* them on the strategy class instead: each is a plain
method of that class afterwards, marked ``@override``, calling ``super()`` of that class.
A hook the strategy writes itself (``async_sgd``'s local ``barrier``, say) is not one of
these: the decorator refuses to install over it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import Any, TypeVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_par import _compat
from lightning_par.paramserver.process import role_name
from lightning_par.strategies._ps_features import check_features

S = TypeVar("S", bound=type)


def server_group_hooks(cls: S) -> S:
    """Class decorator: give ``cls`` (a ``ParStrategy`` holding ``self.servers``, a
    ``ServerGroup``, and ``self.client``, its client or None) the hand-offs below."""

    def base(self: Any) -> Any:
        return super(cls, self)  # what super() means in the body of cls

    def check_before_launch(self, trainer: pl.Trainer | None) -> None:
        """Refuse what the servers cannot do exactly (:mod:`._ps_features`), and what every
        strategy refuses (a checkpoint that cannot be read)."""
        base(self).check_before_launch(trainer)
        check_features(self.strategy_name, self.lightning_module, trainer, _compat.layer_sync(self))

    def rank_name(self, rank: int) -> str:
        return role_name(self.world_size, rank)

    @property  # type: ignore[misc]
    def worker_group(self) -> Any:
        """The workers' process group (ranks ``0 .. W-1``; the servers are not in it)."""
        return self.servers.workers.group

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.servers.workers.broadcast(obj, src)

    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False):
        return base(self).all_gather(
            tensor, group=group or self.worker_group, sync_grads=sync_grads
        )

    def sync_model_states(self) -> None:
        """Every worker starts from worker 0's weights (over the workers' group)."""
        self.servers.workers.sync_model_states(self.model)

    def gradient_buckets(self) -> Any:
        """Gradient accumulation: no push on the accumulating micro-steps."""
        return self.client.buckets if self.client is not None else None

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        self.servers.pre_backward()

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        self.servers.post_backward()

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any):
        """The servers step the optimiser (:meth:`ServerGroup.step`)."""
        if self.client is None:
            return base(self).optimizer_step(optimizer, closure, model, **kwargs)
        return self.servers.step(optimizer, closure, model)

    def settled(hook: str) -> Callable[..., Any]:
        def step(self, *args: Any, **kwargs: Any) -> Any:
            self.servers.settle()  # every pulled layer is in before evaluating
            return getattr(base(self), hook)(*args, **kwargs)

        step.__name__ = hook
        return step

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self.client is None:  # after fit: the state the servers held at its end
            return self.servers.final_state or base(self).optimizer_state(optimizer)
        return self.client.gather_state()  # complete on worker 0, which writes the file

    def on_train_end(self) -> None:
        # the last pulls are the run's: waited for (and traced) before the state is gathered
        # outside the trace, for the script (a fork launch) or for a later save (below)
        self.servers.settle()
        base(self).on_train_end()
        if self.client is not None and self.servers.ranks_outlive_the_call():
            # the script goes on in these ranks and may save a checkpoint after the servers
            # are gone: keep what they hold now
            with self.trace.left_out() if self.trace is not None else nullcontext():
                self.servers.final_state = self.client.gather_state()

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self.client is None:
            return base(self).load_optimizer_state_dict(checkpoint)
        states = checkpoint["optimizer_states"]
        if not states:  # as Lightning's DDP: a checkpoint without one starts the optimiser anew
            rank_zero_warn(
                f"{self.strategy_name}: the checkpoint holds no optimiser state (saved in the "
                "script after a fork launch of Lightning's own DDP?); the servers' optimiser "
                "starts afresh"
            )
            return None
        self.client.load_state(states[0])

    def on_exception(self, exception: BaseException) -> None:
        # under torchrun Lightning calls this in the rank (a fork launch: in the main process)
        self.servers.on_exception(exception)

    def describe_failure(self, error: BaseException) -> None:
        self.servers.describe_failure(error)

    def teardown(self) -> None:
        self.servers.close()
        base(self).teardown()

    hooks = {
        "check_before_launch": check_before_launch,
        "rank_name": rank_name,
        "worker_group": worker_group,
        "broadcast": broadcast,
        "all_gather": all_gather,
        "sync_model_states": sync_model_states,
        "gradient_buckets": gradient_buckets,
        "pre_backward": pre_backward,
        "post_backward": post_backward,
        "optimizer_step": optimizer_step,
        **{name: settled(name) for name in ("validation_step", "test_step", "predict_step")},
        "optimizer_state": optimizer_state,
        "on_train_end": on_train_end,
        "load_optimizer_state_dict": load_optimizer_state_dict,
        "on_exception": on_exception,
        "describe_failure": describe_failure,
        "teardown": teardown,
    }
    for name, hook in hooks.items():
        if name in vars(cls):
            raise TypeError(f"{cls.__name__}.{name} is installed by server_group_hooks")
        func = hook.fget if isinstance(hook, property) else hook
        func.__qualname__ = f"{cls.__qualname__}.{name}"
        func.__module__ = cls.__module__
        if name != "worker_group":
            override(func)  # a Lightning hook (worker_group is ours)
        setattr(cls, name, hook)
    return cls
