"""Every private Lightning and torch name lightning_par relies on, in one place.

Lightning's strategy API does not cover everything a parameter server or a lost-worker
launch needs (a per-step broadcast among some ranks only, the barrier around
``prepare_data``, a launch join that tolerates a dead rank), so a few private names are
used. Each is reached through a function here that raises :class:`CompatError`, naming
the name, the versions it was written for and what depends on it, if the name has moved;
``tests/test_compat.py`` and ``tests/test_compat_loops.py`` check every one against the
installed versions, so an upgrade that moves one fails there rather than degrading
silently in a run. Callers write ``_compat.<name>``; the names live by concern:

* :mod:`.lookup`: how a private name is reached, and :class:`CompatError`;
* :mod:`.processes`: starting ranks (torch's process context, Lightning's launchers, a
  forkserver rank's memory and random state, the default store and backend);
* :mod:`.loops`: the trainer's loops and data;
* :mod:`.strategy`: a strategy's own private fields and Lightning's helpers it calls;
* :mod:`.step`: the optimiser step when it runs elsewhere or across stages;
* :mod:`.summary`: Lightning's ``ModelSummary``.

Written against torch 2.4-2.14 and lightning 2.5-2.6.
"""

from lightning_par._compat.lookup import WRITTEN_FOR, CompatError, private, private_class
from lightning_par._compat.loops import (
    barrier_around_prepare_data,
    batches_that_stepped,
    epoch_loop_broadcasts,
    first_batch,
    num_ready_batches_reached,
    preload_checkpoint,
    replace_sigterm_broadcast,
    reset_combined_loader,
    set_use_distributed_sampler,
    uses_distributed_sampler,
    wrap_setup_data,
)
from lightning_par._compat.processes import (
    MultiProcessingLauncher,
    SubprocessScriptLauncher,
    WorkerOutput,
    default_process_group_backend,
    default_store,
    disable_module_memory_sharing,
    patched_start_processes,
    replaced_process_observer,
    rng_states,
    script_command,
    set_rng_states,
)
from lightning_par._compat.step import (
    after_closure,
    in_backward_pass,
    mark_optimizer_stepped,
    replace_clip_grad_by_norm,
    scaler_found_inf,
)
from lightning_par._compat.strategy import (
    attached_trainer,
    layer_sync,
    log_hyperparameters,
    logger_version_field,
    optimizers_to_device,
    process_group_backend,
    set_ddp_kwargs,
    set_process_group_backend,
    strategy_timeout,
    sync_module_states,
)
from lightning_par._compat.summary import model_summary_options, summary_data

__all__ = [
    "WRITTEN_FOR",
    "CompatError",
    "MultiProcessingLauncher",
    "SubprocessScriptLauncher",
    "WorkerOutput",
    "after_closure",
    "attached_trainer",
    "barrier_around_prepare_data",
    "batches_that_stepped",
    "default_process_group_backend",
    "default_store",
    "disable_module_memory_sharing",
    "epoch_loop_broadcasts",
    "first_batch",
    "in_backward_pass",
    "layer_sync",
    "log_hyperparameters",
    "logger_version_field",
    "mark_optimizer_stepped",
    "model_summary_options",
    "num_ready_batches_reached",
    "optimizers_to_device",
    "patched_start_processes",
    "replaced_process_observer",
    "preload_checkpoint",
    "private",
    "private_class",
    "process_group_backend",
    "replace_clip_grad_by_norm",
    "replace_sigterm_broadcast",
    "reset_combined_loader",
    "rng_states",
    "script_command",
    "scaler_found_inf",
    "set_ddp_kwargs",
    "set_process_group_backend",
    "set_rng_states",
    "set_use_distributed_sampler",
    "strategy_timeout",
    "summary_data",
    "sync_module_states",
    "uses_distributed_sampler",
    "wrap_setup_data",
]
