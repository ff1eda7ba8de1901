"""What a fork launch carries back from rank 0 to the script: the weights and the training
state, so that ``trainer.save_checkpoint`` in the script writes what one process would.

Lightning's fork launcher brings back the weights alone (``_recover_results_in_main_process``):
a checkpoint saved in the script then has no optimiser state, and ``fit(ckpt_path=...)``
from it restarts momentum, Adam's moments and the step count. Here every rank dumps the
whole checkpoint at the end of ``fit`` (model-split strategies gather their pieces, the
parameter servers send their optimiser shards; Lightning's ``dump_checkpoint``), while every
component is still up, and rank 0 writes it in two files:

* ``weights.ckpt``: the state dict, which the script loads into its model (as Lightning does);
* ``training.ckpt``: the rest (optimiser and scheduler states, loops, callbacks, step and
  epoch), which the strategy keeps and merges into the script's next checkpoint.

After every launch (fit, validate, test, predict) rank 0 also writes its random states
(``random.pt``: the script goes on drawing what one process would) and its trace
(``trace.json``). All of it travels as files, not through the queue Lightning returns
results by: the main process reads that queue only once every rank has ended, so a rank
whose result outgrew a pipe's buffer (64 KiB) would wait for it forever. The ``.pt`` files
are read with ``weights_only=True``: no object of another process is unpickled. When a
fault-tolerant run lost rank 0, the survivor that took over its share sends all of this
instead (its random states, not rank 0's). A training
state that holds some other type (a callback's custom state) is left behind with a warning;
the weights still arrive.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_par import _compat
from lightning_par.comm.trace import trace_from_dict, trace_to_dict
from lightning_par.launch.lost import REPORTS_ENV, make_private_folder

#: Keys of a checkpoint the script's own dump writes better than the rank's (its module's
#: state dict, which the user may have changed since, and hyper-parameters it already holds).
SCRIPT_KEYS = (
    "state_dict",
    "hyper_parameters",
    "hparams_name",
    "hparams_type",
    "datamodule_hyper_parameters",
    "datamodule_hparams_name",
    "datamodule_hparams_type",
)
WEIGHTS_FILE, TRAINING_FILE = "weights.ckpt", "training.ckpt"
#: Prefix of the temporary folder that carries rank 0's weights and training state back.
WEIGHTS_PREFIX = "lightning_par-weights-"
RANDOM_FILE, TRACE_FILE = "random.pt", "trace.json"


@dataclass
class CarriedBack:
    """What the script reads of rank 0's folder (None: not sent, or not readable)."""

    state_dict: dict[str, Any] | None = None
    training: dict[str, Any] | None = None
    random: dict[str, Any] | None = None
    trace: dict[str, Any] | None = None


def dump_rank_checkpoint(trainer: pl.Trainer) -> dict[str, Any]:
    """The whole checkpoint as ``trainer.save_checkpoint`` would write it (every rank calls
    this: model-split strategies gather their pieces in it)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def dump_for_script(strategy: Any) -> None:
    """At the end of ``fit``, in each rank of a launch that carries results back (a fork
    launch's), while every component (servers, stages) is still up: keep the whole
    checkpoint in ``strategy.end_of_fit_checkpoint`` (:func:`output_for_script` sends it;
    the trace leaves the gathering out)."""
    if getattr(strategy.launcher, "carries_back", False) and not strategy.holds_whole_model:
        trace = strategy.trace
        with trace.left_out() if trace is not None else nullcontext():
            strategy.end_of_fit_checkpoint = dump_rank_checkpoint(strategy.lightning_module.trainer)


def save_for_script(
    folder: str, checkpoint: Mapping[str, Any] | None, trace: dict[str, Any] | None
) -> str | None:
    """Write what rank 0 sends into ``folder``; returns the weights' path (None: no fit)."""
    torch.save(random_states(), os.path.join(folder, RANDOM_FILE))
    if trace is not None:
        with open(os.path.join(folder, TRACE_FILE), "w") as f:
            json.dump(trace, f)
    if checkpoint is None:
        return None
    weights = os.path.join(folder, WEIGHTS_FILE)
    torch.save(checkpoint["state_dict"], weights)
    training = {k: v for k, v in checkpoint.items() if k not in SCRIPT_KEYS}
    torch.save(training, os.path.join(folder, TRAINING_FILE))
    return weights


def load_in_script(folder: str) -> CarriedBack:
    """Read what :func:`save_for_script` wrote (in the script's process)."""
    carried = CarriedBack()
    path = os.path.join(folder, WEIGHTS_FILE)
    if os.path.exists(path):
        carried.state_dict = torch.load(path, map_location="cpu", weights_only=True)
        carried.training = _training_state(os.path.join(folder, TRAINING_FILE))
    path = os.path.join(folder, RANDOM_FILE)
    if os.path.exists(path):
        carried.random = torch.load(path, weights_only=True)
    path = os.path.join(folder, TRACE_FILE)
    if os.path.exists(path):
        with open(path) as f:
            carried.trace = json.load(f)
    return carried


def _training_state(path: str) -> dict[str, Any] | None:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        first_line = str(error).strip().splitlines()[0]
        rank_zero_warn(
            "lightning_par: the training state of rank 0 holds a type that is not read "
            f"across processes ({first_line}); a checkpoint saved in this script after "
            "`fit` has the weights but no optimiser state. Save checkpoints during `fit` "
            "(ModelCheckpoint) to keep it."
        )
        return None


def with_training_state(
    checkpoint: dict[str, Any], training: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The script's ``checkpoint`` completed with rank 0's training state (unchanged for a
    weights-only checkpoint, or when there is none)."""
    if training is None or "optimizer_states" not in checkpoint:
        return checkpoint
    return {**checkpoint, **training, **{k: checkpoint[k] for k in SCRIPT_KEYS if k in checkpoint}}


def random_states() -> dict[str, Any]:
    """This process's CPU random states as tensors and plain values (``weights_only``)."""
    states = _compat.rng_states()
    kind, key, pos, has_gauss, gauss = states["numpy"]
    return {**states, "numpy": (kind, torch.from_numpy(key.astype(np.int64)), pos,
                                has_gauss, gauss)}  # fmt: skip


def restore_random_states(states: Mapping[str, Any]) -> None:
    """Go on from what :func:`random_states` read (in rank 0)."""
    kind, key, pos, has_gauss, gauss = states["numpy"]
    numpy_state = (kind, key.numpy().astype(np.uint32), pos, has_gauss, gauss)
    _compat.set_rng_states({**states, "numpy": numpy_state})


def output_for_script(
    strategy: Any, trainer: pl.Trainer, results: Any, extra: dict[str, Any], queue: Any
) -> Any:
    """At the end of a launch, in every rank: the ``_WorkerOutput`` rank 0 returns (None
    elsewhere), its weights, training state, random states and trace written to a folder of
    its own that the script removes once read. At the end of ``fit`` every rank takes part
    in gathering the checkpoint first. A survivor that took over rank 0's share
    (``fault_tolerant``, :mod:`._leader`) puts the output on ``queue`` itself: Lightning puts
    rank 0's alone."""
    callback = trainer.checkpoint_callback
    best_model_path = getattr(callback, "best_model_path", None) if callback else None
    checkpoint = None
    if trainer.state.fn == TrainerFn.FITTING:
        checkpoint = strategy.end_of_fit_checkpoint or {
            "state_dict": strategy.lightning_module_state_dict()
        }
        strategy.end_of_fit_checkpoint = None
    took_over = strategy.local_rank != 0 and strategy.is_global_zero
    if strategy.local_rank != 0 and not took_over:
        return None
    # inside the launch's own folder where there is one: the launcher removes it on the way
    # out, however it ends (killed or interrupted before it read this one, too)
    reports = os.environ.get(REPORTS_ENV)
    within = reports if reports and make_private_folder(reports) else None
    folder = tempfile.mkdtemp(prefix=WEIGHTS_PREFIX, dir=within)
    trace = getattr(strategy, "trace", None)
    weights_path = save_for_script(
        folder, checkpoint, trace_to_dict(trace) if trace is not None else None
    )
    extra = {**extra, "lightning_par_folder": folder}
    output = _compat.WorkerOutput(best_model_path, weights_path, trainer.state, results, extra)
    if took_over:
        queue.put(move_data_to_device(output, "cpu"))
        return None
    return output


def recover_in_script(strategy: Any, trainer: pl.Trainer, worker_output: Any) -> Any:
    """In the script: read rank 0's folder into the script's model, the strategy's training
    state, the random states and the trace, and remove it; the rest of ``worker_output``
    for Lightning (its weights already read)."""
    folder = worker_output.extra.get("lightning_par_folder")
    if folder is not None:
        carried = load_in_script(folder)
        shutil.rmtree(folder, ignore_errors=True)
        if carried.state_dict is not None:  # into the script's model, as Lightning does
            trainer.lightning_module.load_state_dict(carried.state_dict, strict=False)
            strategy.training_state = carried.training  # for save_checkpoint
        if carried.random is not None:
            restore_random_states(carried.random)
        if carried.trace is not None:
            strategy.trace = trace_from_dict(carried.trace)
    return worker_output._replace(weights_path=None)
