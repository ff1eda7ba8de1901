"""The optimiser step when it runs elsewhere (the parameter servers) or across stages: the
hooks after the closure, the scheduler's "stepped" flag, the loss scaler's found-inf flags,
clipping by the whole model's norm, and whether autograd is in a backward pass."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_par._compat.lookup import private, require


def after_closure(precision_plugin: Any, module: Any, optimizer: Any) -> None:
    """What Lightning's precision plugin does after the training closure (the
    ``on_before_optimizer_step`` hooks) when the optimiser step itself runs elsewhere."""
    require(
        precision_plugin, "_after_closure", "Precision._after_closure",
        "the on_before_optimizer_step hooks of parameter_server and async_sgd",
    )  # fmt: skip
    precision_plugin._after_closure(module, optimizer)


def mark_optimizer_stepped(optimizer: Any) -> None:
    """Tell torch's LR schedulers the optimiser has stepped (the servers stepped it), so
    they do not warn "lr_scheduler.step() before optimizer.step()"."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    if isinstance(optimizer, LightningOptimizer):
        require(optimizer, "_optimizer", "LightningOptimizer._optimizer", "the servers' step")
    inner = getattr(optimizer, "_optimizer", optimizer)
    inner._opt_called = True  # read by torch.optim.lr_scheduler (checked in test_compat)


def scaler_found_inf(scaler: Any, optimizer: Any) -> dict[Any, Any]:
    """A ``GradScaler``'s found-inf flags (device -> tensor) for ``optimizer`` after
    ``unscale_``: the flags the pipeline stages agree on, so all skip the same steps."""
    require(
        scaler, "_per_optimizer_states", "GradScaler._per_optimizer_states",
        "one loss scale for every pipeline stage under 16-mixed",
    )  # fmt: skip
    return scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]


def replace_clip_grad_by_norm(precision_plugin: Any, clip: Callable[[Any, float], None]) -> None:
    """Make Lightning's clipping by norm (``Trainer(gradient_clip_val=...)``) call ``clip``
    (``Precision.clip_grad_by_norm(optimizer, clip_val)``, called by
    ``Precision.clip_gradients``): a split model clips by the whole model's norm."""
    require(
        precision_plugin, "clip_grad_by_norm", "Precision.clip_grad_by_norm",
        "clipping a split model by the whole model's norm",
    )  # fmt: skip
    precision_plugin.clip_grad_by_norm = clip


def in_backward_pass() -> bool:
    """True while autograd runs a backward pass (a re-materialising forward runs in one)."""
    current = private(
        "torch._C", "_current_graph_task_id",
        "deferred BatchNorm not counting recomputed forwards",
    )  # fmt: skip
    return current() != -1
