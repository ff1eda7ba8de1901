"""The trainer's loops and data: the per-step SIGTERM broadcast, the end of an epoch, the
first batch, the training loader built again, the barrier around ``prepare_data`` and the
distributed sampler."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from lightning_par._compat.lookup import moved, require


def replace_sigterm_broadcast(trainer: Any, broadcast: Callable[[], None]) -> None:
    """Lightning (>= 2.5.1) broadcasts a SIGTERM flag from rank 0 on the default group
    before every training batch (``_TrainingEpochLoop._broadcast_sigterm_tensor``); run
    ``broadcast`` instead (the servers are in the default group but not in the loop).
    Lightning 2.5.0 broadcasts nothing there: nothing to replace."""
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(loop, "_broadcast_sigterm_tensor"):
        if epoch_loop_broadcasts(type(loop)):  # it broadcasts, under a name we do not know
            raise moved(
                "_TrainingEpochLoop._broadcast_sigterm_tensor",
                "the per-step SIGTERM broadcast among the workers only (parameter_server)",
            )
        return
    loop._broadcast_sigterm_tensor = broadcast


def epoch_loop_broadcasts(loop_cls: type) -> bool:
    """Whether Lightning's training epoch loop makes a collective of its own."""

    return "broadcast(" in inspect.getsource(loop_cls)


def num_ready_batches_reached(trainer: Any) -> bool:
    """Whether the epoch loop is at the last batch of its epoch."""
    loop = trainer.fit_loop.epoch_loop
    require(
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
    require(loop, "_data_source", "_Loop._data_source", "the pipeline's look at one batch")
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
    require(
        fit_loop, "_combined_loader", "_FitLoop._combined_loader",
        "async_sgd's shared batches when a scheduler counts steps early",
    )  # fmt: skip
    fit_loop._combined_loader = None


def wrap_setup_data(fit_loop: Any, after: Callable[[], None]) -> None:
    """Run ``after`` each time Lightning's ``fit_loop.setup_data()`` has run (the loop sets
    its data loaders and ``max_batches`` up there)."""
    require(fit_loop, "setup_data", "_FitLoop.setup_data", "async_sgd's shared batches")
    original = fit_loop.setup_data

    def setup_data() -> None:
        original()
        after()

    fit_loop.setup_data = setup_data


def barrier_around_prepare_data(trainer: Any, barrier: Callable[[], Any]) -> None:
    """Lightning brackets ``prepare_data`` with ``_InfiniteBarrier()`` (a new group of every
    rank); make it use ``barrier()`` (a context manager) for this trainer instead."""
    from lightning.pytorch.trainer.connectors import data_connector

    needed_by = "the barrier around prepare_data among the workers only (parameter_server)"
    require(data_connector, "_InfiniteBarrier", "data_connector._InfiniteBarrier", needed_by)
    require(trainer, "_data_connector", "Trainer._data_connector", needed_by)
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


def uses_distributed_sampler(trainer: Any) -> bool:
    """Whether Lightning will put a ``DistributedSampler`` on this trainer's loaders."""
    connector = getattr(trainer, "_accelerator_connector", None)
    require(
        connector, "use_distributed_sampler", "Trainer._accelerator_connector",
        "sharding on-device training batches by rank",
    )  # fmt: skip
    return bool(connector.use_distributed_sampler)


def set_use_distributed_sampler(trainer: Any, value: bool) -> None:
    """Whether Lightning wraps the training sampler in a ``DistributedSampler``."""
    connector = getattr(trainer, "_accelerator_connector", None)
    require(
        connector, "use_distributed_sampler",
        "Trainer._accelerator_connector.use_distributed_sampler",
        "strategies whose ranks must all read the same batches",
    )  # fmt: skip
    connector.use_distributed_sampler = value


def preload_checkpoint(trainer: Any, checkpoint: dict[str, Any]) -> None:
    """Make the trainer's running call restore ``checkpoint`` (weights, optimisers,
    schedulers, loops, callbacks) as if read from a ``ckpt_path``: Lightning loads a path's
    checkpoint into ``_loaded_checkpoint`` after ``setup_environment`` and restores from it;
    with no path it keeps the one found there."""
    needed_by = "a joiner's training state, received from a peer (fault_tolerant)"
    require(trainer, "_checkpoint_connector", "Trainer._checkpoint_connector", needed_by)
    connector = trainer._checkpoint_connector
    require(connector, "_loaded_checkpoint", "_CheckpointConnector._loaded_checkpoint", needed_by)
    connector._loaded_checkpoint = checkpoint


def batches_that_stepped(trainer: Any, value: int | None = None) -> int:
    """The training loop's count of batches that stepped (the loggers' step); set to
    ``value`` if given. Lightning counts one more when it restores a checkpoint saved in the
    middle of a batch."""
    loop = trainer.fit_loop.epoch_loop
    needed_by = "a joiner's logging step (fault_tolerant)"
    require(loop, "_batches_that_stepped", "_TrainingEpochLoop._batches_that_stepped", needed_by)
    if value is not None:
        loop._batches_that_stepped = value
    return loop._batches_that_stepped
