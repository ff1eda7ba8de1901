"""Every private Lightning and torch name lightning_par relies on, in one place.

Lightning's strategy API does not cover everything a parameter server or a lost-worker
launch needs (a per-step broadcast among some ranks only, the barrier around
``prepare_data``, a launch join that tolerates a dead rank), so a few private names are
used. Each is reached through a function here that raises :class:`CompatError`, naming
the name, the versions it was written for and what depends on it, if the name has moved;
``tests/test_compat.py`` checks every one against the installed versions, so an upgrade
that moves one fails there rather than degrading silently in a run.

Written against torch 2.4-2.14 and lightning 2.5-2.6.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

WRITTEN_FOR = "torch >= 2.4 and lightning >= 2.5, < 3"


class CompatError(RuntimeError):
    """A private Lightning/torch name lightning_par relies on is gone in this version."""


def _moved(name: str, needed_by: str) -> CompatError:
    import lightning
    import torch

    return CompatError(
        f"{name} is missing in torch {torch.__version__} / lightning {lightning.__version__}; "
        f"lightning_par needs it for {needed_by} (written for {WRITTEN_FOR}). Install a "
        "supported version, or update lightning_par/_compat.py"
    )


def private(module: str, name: str, needed_by: str) -> Any:
    """``module.name`` (a private attribute), or :class:`CompatError` if it has moved."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise _moved(f"{module}.{name}", needed_by) from err


def _require(obj: Any, attr: str, name: str, needed_by: str) -> None:
    if not hasattr(obj, attr):
        raise _moved(name, needed_by)


# ---- torch -----------------------------------------------------------------------------------
def default_store() -> Any:
    """The default process group's key-value store (torch has no public accessor).

    Raises :class:`CompatError` if the accessor moved; whatever torch raises (no group)
    otherwise."""
    get = private(
        "torch.distributed.distributed_c10d", "_get_default_store",
        "a parameter server's diagnosis reaching the workers",
    )  # fmt: skip
    return get()


@contextmanager
def patched_start_processes(wrap: Callable[[Any], Any]) -> Iterator[None]:
    """While inside, every ``torch.multiprocessing.start_processes`` context (Lightning's
    fork launch calls it through the module) is passed to ``wrap`` before it is returned.
    The context's ``processes``, ``sentinels`` and ``error_files`` must exist."""
    import torch.multiprocessing as tmp

    needed_by = "a fork launch that goes on without a lost worker (async_sgd)"
    _require(tmp, "start_processes", "torch.multiprocessing.start_processes", needed_by)
    for attr in ("processes", "sentinels", "error_files", "join"):
        _require_context_attr(attr, needed_by)
    original = tmp.start_processes

    def start_processes(*args: Any, **kwargs: Any) -> Any:
        return wrap(original(*args, **kwargs))

    tmp.start_processes = start_processes
    try:
        yield
    finally:
        tmp.start_processes = original


def _require_context_attr(attr: str, needed_by: str) -> None:
    import inspect

    from torch.multiprocessing.spawn import ProcessContext

    try:  # instance attributes: set in __init__
        source = inspect.getsource(ProcessContext.__init__)
    except (OSError, TypeError):  # no source shipped: cannot tell, trust the version
        return
    if not hasattr(ProcessContext, attr) and f"self.{attr} =" not in source:
        raise _moved(f"torch.multiprocessing.ProcessContext.{attr}", needed_by)


def mark_optimizer_stepped(optimizer: Any) -> None:
    """Tell torch's LR schedulers the optimiser has stepped (the servers stepped it), so
    they do not warn "lr_scheduler.step() before optimizer.step()"."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    if isinstance(optimizer, LightningOptimizer):
        _require(optimizer, "_optimizer", "LightningOptimizer._optimizer", "the servers' step")
    inner = getattr(optimizer, "_optimizer", optimizer)
    inner._opt_called = True  # read by torch.optim.lr_scheduler (checked in test_compat)


# ---- lightning -------------------------------------------------------------------------------
def attached_trainer(module: Any) -> Any:
    """The trainer ``module`` is attached to, or None (``module.trainer`` raises then)."""
    if module is None:
        return None
    _require(module, "_trainer", "LightningModule._trainer", "strategies' teardown and setup")
    return module._trainer


def replace_sigterm_broadcast(trainer: Any, broadcast: Callable[[], None]) -> None:
    """Lightning (>= 2.5.1) broadcasts a SIGTERM flag from rank 0 on the default group
    before every training batch (``_TrainingEpochLoop._broadcast_sigterm_tensor``); run
    ``broadcast`` instead (the servers are in the default group but not in the loop).
    Lightning 2.5.0 broadcasts nothing there: nothing to replace."""
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(loop, "_broadcast_sigterm_tensor"):
        if epoch_loop_broadcasts(type(loop)):  # it broadcasts, under a name we do not know
            raise _moved(
                "_TrainingEpochLoop._broadcast_sigterm_tensor",
                "the per-step SIGTERM broadcast among the workers only (parameter_server)",
            )
        return
    loop._broadcast_sigterm_tensor = broadcast


def epoch_loop_broadcasts(loop_cls: type) -> bool:
    """Whether Lightning's training epoch loop makes a collective of its own."""
    import inspect

    return "broadcast(" in inspect.getsource(loop_cls)


def num_ready_batches_reached(trainer: Any) -> bool:
    """Whether the epoch loop is at the last batch of its epoch."""
    loop = trainer.fit_loop.epoch_loop
    _require(
        loop, "_num_ready_batches_reached", "_TrainingEpochLoop._num_ready_batches_reached",
        "local_sgd's average at the end of an epoch",
    )  # fmt: skip
    return bool(loop._num_ready_batches_reached())


def first_batch(trainer: Any) -> Any:
    """The first batch of the data the running stage (fit, validate, test, predict) reads,
    from a data loader built for the purpose (the loop builds its own later)."""
    loops = {"validate": trainer.validate_loop, "test": trainer.test_loop,
             "predict": trainer.predict_loop}  # fmt: skip
    loop = loops.get(getattr(trainer.state.fn, "value", trainer.state.fn), trainer.fit_loop)
    _require(loop, "_data_source", "_Loop._data_source", "the pipeline's look at one batch")
    loaders = loop._data_source.dataloader()
    if isinstance(loaders, (list, tuple)):
        loaders = loaders[0]
    if isinstance(loaders, dict):
        loaders = next(iter(loaders.values()))
    generators = _loader_generators(loaders)
    states = [g.get_state() for g in generators]
    try:
        return next(iter(loaders))
    finally:  # the user's own loader (fit(model, loader)) then shuffles as if never read
        for generator, state in zip(generators, states):
            generator.set_state(state)


def _loader_generators(loader: Any) -> list[Any]:
    """The ``torch.Generator`` objects a data loader draws from when iterated (its own, its
    sampler's, its batch sampler's sampler's): starting an iterator advances them."""
    import torch

    found: dict[int, Any] = {}
    batch_sampler = getattr(loader, "batch_sampler", None)
    for owner in (loader, getattr(loader, "sampler", None),
                  getattr(batch_sampler, "sampler", None)):  # fmt: skip
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator):
            found[id(generator)] = generator
    return list(found.values())


def reset_combined_loader(fit_loop: Any) -> None:
    """Make the fit loop build its training data loader again on its next ``setup_data``."""
    _require(
        fit_loop, "_combined_loader", "_FitLoop._combined_loader",
        "async_sgd's shared batches when a scheduler counts steps early",
    )  # fmt: skip
    fit_loop._combined_loader = None


def barrier_around_prepare_data(trainer: Any, barrier: Callable[[], Any]) -> None:
    """Lightning brackets ``prepare_data`` with ``_InfiniteBarrier()`` (a new group of every
    rank); make it use ``barrier()`` (a context manager) for this trainer instead."""
    from lightning.pytorch.trainer.connectors import data_connector

    needed_by = "the barrier around prepare_data among the workers only (parameter_server)"
    _require(data_connector, "_InfiniteBarrier", "data_connector._InfiniteBarrier", needed_by)
    _require(trainer, "_data_connector", "Trainer._data_connector", needed_by)
    connector = trainer._data_connector
    original = connector.prepare_data

    def prepare_data() -> None:
        saved = data_connector._InfiniteBarrier
        data_connector._InfiniteBarrier = barrier
        try:
            original()
        finally:
            data_connector._InfiniteBarrier = saved

    connector.prepare_data = prepare_data


def after_closure(precision_plugin: Any, module: Any, optimizer: Any) -> None:
    """What Lightning's precision plugin does after the training closure (the
    ``on_before_optimizer_step`` hooks) when the optimiser step itself runs elsewhere."""
    _require(
        precision_plugin, "_after_closure", "Precision._after_closure",
        "the on_before_optimizer_step hooks of parameter_server and async_sgd",
    )  # fmt: skip
    precision_plugin._after_closure(module, optimizer)


def sync_module_states(module: Any) -> None:
    """Lightning's broadcast of rank 0's parameters and buffers."""
    sync = private(
        "lightning.pytorch.overrides.distributed", "_sync_module_states",
        "the reference strategy's start from rank 0's weights",
    )  # fmt: skip
    sync(module)


def scaler_found_inf(scaler: Any, optimizer: Any) -> dict[Any, Any]:
    """A ``GradScaler``'s found-inf flags (device -> tensor) for ``optimizer`` after
    ``unscale_``: the flags the pipeline stages agree on, so all skip the same steps."""
    _require(
        scaler, "_per_optimizer_states", "GradScaler._per_optimizer_states",
        "one loss scale for every pipeline stage under 16-mixed",
    )  # fmt: skip
    return scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]


def in_backward_pass() -> bool:
    """True while autograd runs a backward pass (a re-materialising forward runs in one)."""
    current = private(
        "torch._C", "_current_graph_task_id",
        "deferred BatchNorm not counting recomputed forwards",
    )  # fmt: skip
    return current() != -1


def default_process_group_backend(device: Any) -> str:
    """Lightning's default backend for a device (``nccl`` for CUDA, else ``gloo``)."""
    get = private(
        "lightning.fabric.utilities.distributed",
        "_get_default_process_group_backend_for_device", "choosing a process group backend",
    )  # fmt: skip
    return get(device)


def optimizers_to_device(optimizers: Any, device: Any) -> None:
    """Move the optimisers' state to ``device`` (Lightning's helper)."""
    move = private(
        "lightning.fabric.utilities.optimizer", "_optimizers_to_device",
        "moving optimiser state with the model",
    )  # fmt: skip
    move(optimizers, device)


def disable_module_memory_sharing(data: Any) -> Any:
    """Copies of the modules and tensors in ``data`` out of shared memory (what Lightning
    does for ``spawn`` ranks; a forkserver rank needs it too, or every rank steps the
    same parameters)."""
    unshare = private(
        "lightning.fabric.strategies.launchers.multiprocessing",
        "_disable_module_memory_sharing", "forkserver ranks owning their weights",
    )  # fmt: skip
    return unshare(data)


def rng_states() -> dict:
    """The CPU random states of torch, numpy and ``random`` (Lightning's collector, without
    CUDA's: reading those would initialise CUDA in the main process)."""
    collect = private("lightning.fabric.utilities.seed", "_collect_rng_states",
                      "forkserver ranks starting from the main process's random state")  # fmt: skip
    return collect(include_cuda=False)


def set_rng_states(states: dict) -> None:
    """Restore what :func:`rng_states` read."""
    private("lightning.fabric.utilities.seed", "_set_rng_states",
            "forkserver ranks starting from the main process's random state")(states)  # fmt: skip


def _class(module: str, name: str, needed_by: str) -> type:
    """A private Lightning class to subclass; if it moved, a stand-in that raises
    :class:`CompatError` when it is used (so importing lightning_par still works)."""
    try:
        return private(module, name, needed_by)
    except CompatError:

        class Missing:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                raise _moved(f"{module}.{name}", needed_by)

        Missing.__name__ = Missing.__qualname__ = name
        return Missing


_LAUNCHERS = "lightning.pytorch.strategies.launchers"
#: Lightning's launcher of a script's other ranks (``popen``), also used for ranks that
#: already exist (torchrun, SLURM).
SubprocessScriptLauncher = _class(
    f"{_LAUNCHERS}.subprocess_script", "_SubprocessScriptLauncher", "popen and torchrun launches"
)
#: Lightning's fork/spawn launcher (its ``_wrapping_function`` is overridden) and the type
#: of what it returns from rank 0.
MultiProcessingLauncher = _class(
    f"{_LAUNCHERS}.multiprocessing", "_MultiProcessingLauncher", "fork and forkserver launches"
)
WorkerOutput = _class(f"{_LAUNCHERS}.multiprocessing", "_WorkerOutput", "fork launches")


def uses_distributed_sampler(trainer: Any) -> bool:
    """Whether Lightning will put a ``DistributedSampler`` on this trainer's loaders."""
    connector = getattr(trainer, "_accelerator_connector", None)
    _require(
        connector, "use_distributed_sampler", "Trainer._accelerator_connector",
        "sharding on-device training batches by rank",
    )  # fmt: skip
    return bool(connector.use_distributed_sampler)


def set_use_distributed_sampler(trainer: Any, value: bool) -> None:
    """Whether Lightning wraps the training sampler in a ``DistributedSampler``."""
    connector = getattr(trainer, "_accelerator_connector", None)
    _require(
        connector, "use_distributed_sampler",
        "Trainer._accelerator_connector.use_distributed_sampler",
        "strategies whose ranks must all read the same batches",
    )  # fmt: skip
    connector.use_distributed_sampler = value


def model_summary_options(callback: Any) -> tuple[int, dict[str, Any]]:
    """``(max_depth, summarize kwargs)`` of a Lightning ``ModelSummary`` callback."""
    for attr in ("_max_depth", "_summarize_kwargs"):
        _require(callback, attr, f"ModelSummary.{attr}", "the whole-model summary of the CLI")
    return callback._max_depth, dict(callback._summarize_kwargs)


def summary_data(summary: Any) -> list[tuple[str, list[str]]]:
    """The table rows of a Lightning ``ModelSummary``."""
    _require(summary, "_get_summary_data", "ModelSummary._get_summary_data",
             "the whole-model summary table")  # fmt: skip
    return summary._get_summary_data()


# ---- the strategy's own private fields (DDPStrategy / ParallelStrategy) ----------------------
def layer_sync(strategy: Any) -> Any:
    """``Trainer(sync_batchnorm=True)``'s ``LayerSync`` plugin of ``strategy``, or None."""
    _require(strategy, "_layer_sync", "Strategy._layer_sync", "refusing sync_batchnorm")
    return strategy._layer_sync


def strategy_timeout(strategy: Any) -> Any:
    """The ``timedelta`` a ``DDPStrategy`` was built with (``timeout=``)."""
    _require(strategy, "_timeout", "DDPStrategy._timeout", "the process group's timeout")
    return strategy._timeout


def process_group_backend(strategy: Any) -> str | None:
    """The backend a ``DDPStrategy`` was asked for (``process_group_backend=``), or None."""
    _require(
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
    _require(strategy, "_ddp_kwargs", "DDPStrategy._ddp_kwargs", "lightning_ddp's DDP options")
    strategy._ddp_kwargs = kwargs


# ---- run-time replacements of Lightning objects' methods -------------------------------------
def replace_clip_grad_by_norm(precision_plugin: Any, clip: Callable[[Any, float], None]) -> None:
    """Make Lightning's clipping by norm (``Trainer(gradient_clip_val=...)``) call ``clip``
    (``Precision.clip_grad_by_norm(optimizer, clip_val)``, called by
    ``Precision.clip_gradients``): a split model clips by the whole model's norm."""
    _require(
        precision_plugin, "clip_grad_by_norm", "Precision.clip_grad_by_norm",
        "clipping a split model by the whole model's norm",
    )  # fmt: skip
    precision_plugin.clip_grad_by_norm = clip


def wrap_setup_data(fit_loop: Any, after: Callable[[], None]) -> None:
    """Run ``after`` each time Lightning's ``fit_loop.setup_data()`` has run (the loop sets
    its data loaders and ``max_batches`` up there)."""
    _require(fit_loop, "setup_data", "_FitLoop.setup_data", "async_sgd's shared batches")
    original = fit_loop.setup_data

    def setup_data() -> None:
        original()
        after()

    fit_loop.setup_data = setup_data
