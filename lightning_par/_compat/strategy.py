"""A strategy's own private fields (``DDPStrategy``, ``ParallelStrategy``) and the Lightning
helpers it calls: the attached trainer, ``sync_batchnorm``'s plugin, the timeout, the process
group backend, DDP's keywords, rank 0's weights to every rank, the optimisers moved."""

from __future__ import annotations

from typing import Any

from lightning_par._compat.lookup import private, require


def attached_trainer(module: Any) -> Any:
    """The trainer ``module`` is attached to, or None (``module.trainer`` raises then)."""
    if module is None:
        return None
    require(module, "_trainer", "LightningModule._trainer", "strategies' teardown and setup")
    return module._trainer


def layer_sync(strategy: Any) -> Any:
    """``Trainer(sync_batchnorm=True)``'s ``LayerSync`` plugin of ``strategy``, or None."""
    require(strategy, "_layer_sync", "Strategy._layer_sync", "refusing sync_batchnorm")
    return strategy._layer_sync


def strategy_timeout(strategy: Any) -> Any:
    """The ``timedelta`` a ``DDPStrategy`` was built with (``timeout=``)."""
    require(strategy, "_timeout", "DDPStrategy._timeout", "the process group's timeout")
    return strategy._timeout


def process_group_backend(strategy: Any) -> str | None:
    """The backend a ``DDPStrategy`` was asked for (``process_group_backend=``), or None."""
    require(
        strategy, "_process_group_backend", "DDPStrategy._process_group_backend",
        "choosing gloo or nccl",
    )  # fmt: skip
    return strategy._process_group_backend


def set_process_group_backend(strategy: Any, backend: str) -> None:
    """Record the backend ``strategy``'s process group uses (read by Lightning's teardown)."""
    process_group_backend(strategy)
    strategy._process_group_backend = backend


def set_ddp_kwargs(strategy: Any, kwargs: dict[str, Any]) -> None:
    """The keywords ``DDPStrategy`` passes to ``DistributedDataParallel`` (``find_unused_...``)."""
    require(strategy, "_ddp_kwargs", "DDPStrategy._ddp_kwargs", "lightning_ddp's DDP options")
    strategy._ddp_kwargs = kwargs


def sync_module_states(module: Any) -> None:
    """Lightning's broadcast of rank 0's parameters and buffers."""
    sync = private(
        "lightning.pytorch.overrides.distributed", "_sync_module_states",
        "the reference strategy's start from rank 0's weights",
    )  # fmt: skip
    sync(module)


def optimizers_to_device(optimizers: Any, device: Any) -> None:
    """Move the optimisers' state to ``device`` (Lightning's helper)."""
    move = private(
        "lightning.fabric.utilities.optimizer", "_optimizers_to_device",
        "moving optimiser state with the model",
    )  # fmt: skip
    move(optimizers, device)


def log_hyperparameters(trainer: Any) -> None:
    """What rank 0 logs as ``fit`` begins: the hyperparameters, the graph, ``save()``."""
    log = private(
        "lightning.pytorch.loggers.utilities", "_log_hyperparams",
        "the first survivor taking over rank 0's loggers (fault_tolerant)",
    )  # fmt: skip
    log(trainer)


def logger_version_field(logger: Any) -> str | None:
    """The field a logger keeps its version in once computed (``_version``), or None for a
    logger without one (its version is not computed from the folders it finds)."""
    return "_version" if "_version" in vars(logger) else None
