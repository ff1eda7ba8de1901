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

and rank 0's random states travel with Lightning's extra results, so the script goes on
drawing what one process would. Both files are read with ``weights_only=True``: no object
of another process is unpickled. A training state that holds some other type (a callback's
custom state) is left behind with a warning; the weights still arrive.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_par import _compat

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
WEIGHTS_FILE = "weights.ckpt"
TRAINING_FILE = "training.ckpt"


def dump_rank_checkpoint(trainer: pl.Trainer) -> dict[str, Any]:
    """The whole checkpoint as ``trainer.save_checkpoint`` would write it (every rank calls
    this: model-split strategies gather their pieces in it)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def save_for_script(checkpoint: Mapping[str, Any], folder: str) -> str:
    """Write ``checkpoint`` into ``folder`` as the two files above; returns the weights'
    path (the one Lightning's launcher passes back)."""
    weights = os.path.join(folder, WEIGHTS_FILE)
    torch.save(checkpoint["state_dict"], weights)
    training = {k: v for k, v in checkpoint.items() if k not in SCRIPT_KEYS}
    torch.save(training, os.path.join(folder, TRAINING_FILE))
    return weights


def load_in_script(weights_path: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The state dict and the training state (None when it cannot be read safely)."""
    state_dict = torch.load(weights_path, map_location="cpu", weights_only=True)
    training_path = os.path.join(os.path.dirname(weights_path), TRAINING_FILE)
    if not os.path.exists(training_path):
        return state_dict, None
    try:
        training = torch.load(training_path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        first_line = str(error).strip().splitlines()[0]
        rank_zero_warn(
            "lightning_par: the training state of rank 0 holds a type that is not read "
            f"across processes ({first_line}); a checkpoint saved in this script after "
            "`fit` has the weights but no optimiser state. Save checkpoints during `fit` "
            "(ModelCheckpoint) to keep it."
        )
        return state_dict, None
    return state_dict, training


def with_training_state(
    checkpoint: dict[str, Any], training: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The script's ``checkpoint`` completed with rank 0's training state (unchanged for a
    weights-only checkpoint, or when there is none)."""
    if training is None or "optimizer_states" not in checkpoint:
        return checkpoint
    return {**checkpoint, **training, **{k: checkpoint[k] for k in SCRIPT_KEYS if k in checkpoint}}


def random_states() -> dict[str, Any]:
    """Rank 0's CPU random states, by value (a tensor would travel as a shared-memory handle
    that dies with the rank)."""
    return {k: v.numpy() if isinstance(v, torch.Tensor) else v
            for k, v in _compat.rng_states().items()}  # fmt: skip


def restore_random_states(states: Mapping[str, Any]) -> None:
    """In the script: go on from what :func:`random_states` read in rank 0."""
    _compat.set_rng_states({k: torch.from_numpy(v) if k == "torch" else v
                            for k, v in states.items()})  # fmt: skip
