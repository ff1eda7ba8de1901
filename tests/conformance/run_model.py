"""One strategy through Lightning's strategy test pipeline, written anew after reading
``run_model_test`` in Lightning's ``tests/tests_pytorch/helpers/pipelines.py``
(Lightning-AI/pytorch-lightning): fit, the parameters moved; the checkpoint reloads to the
weights fit left; ``validate`` and ``test`` leave them as they were; and, beyond the original
(which only restores), a resume: one epoch (4 steps) saved, resumed to 8, against 8 straight.

The model is :class:`_feature_cells.Tiny` (an MLP, SGD with momentum 0.9, so a resume that
drops the optimiser state lands elsewhere); its loaders read this rank's shard. Three fits
and two evaluations per strategy, in whatever ranks the caller started (``run_on_ranks``)
or in the test process for the strategies that start their own processes.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from _feature_cells import Tiny, _factory, _weights, make_trainer
from lightning.pytorch.callbacks import ModelCheckpoint

FEATURE = "plain"  # (no feature switched on: SGD with momentum 0.9, an epoch of 4 batches)
EVAL = {"limit_val_batches": 2, "limit_test_batches": 2}


def _largest(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float | None:
    """The largest absolute difference, or ``None`` when the two do not hold the same
    tensors (a pipeline or tensor-parallel rank other than 0 holds only its part; rank 0
    holds the full model and must compare)."""
    if set(a) != set(b) or any(a[k].shape != b[k].shape for k in b):
        return None
    return float(max((np.abs(a[k] - b[k]).max() for k in b if b[k].size), default=0.0))


def epochs(n: int) -> dict[str, int]:
    """Whole epochs: Lightning resumes a checkpoint written at a train epoch's end exactly
    (one written when ``max_steps`` stopped ``fit`` restarts with a shorter epoch)."""
    return {"max_epochs": n, "max_steps": -1}


def _model(shards: bool) -> Tiny:
    model = Tiny(FEATURE)
    model.shards = shards
    return model


def _local(model: Tiny) -> dict[str, np.ndarray]:
    """This rank's own tensors (a pipeline or tensor-parallel rank: its part)."""
    return {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()
            if v.is_floating_point()}  # fmt: skip


def run_model(name: str, tmp: str) -> dict[str, Any]:
    """Strategy ``name`` through the pipeline; the measured gaps (rank 0 holds the full
    model's), or ``error`` with the exception's first line."""
    make, devices, shards = _factory(name)
    os.makedirs(tmp, exist_ok=True)
    ckpt, blank = os.path.join(tmp, "epoch.ckpt"), os.path.join(tmp, "blank.ckpt")
    try:
        model = _model(shards)
        initial = _local(model)
        saver = ModelCheckpoint(dirpath=tmp, filename="epoch", save_on_train_epoch_end=True,
                                enable_version_counter=False)  # fmt: skip
        trainer = make_trainer(make(), devices, FEATURE, tmp, **EVAL, **epochs(1),
                               callbacks=[saver], enable_checkpointing=True)  # fmt: skip
        trainer.fit(model)  # one epoch (4 steps), saved at its end
        fitted = _weights(trainer, model)
        mine = _local(model)
        checkpoint = torch.load(ckpt, map_location="cpu", weights_only=False)
        _model(shards).load_state_dict(checkpoint["state_dict"])  # (strict: the full model)
        saved = {k: v.float().numpy() for k, v in checkpoint["state_dict"].items()
                 if v.is_floating_point()}  # fmt: skip
        trainer.validate(model, verbose=False)
        trainer.test(model, verbose=False)
        evaluated = _local(model)

        straight = make_trainer(make(), devices, FEATURE, "", **epochs(2))
        straight_model = _model(shards)
        straight.fit(straight_model)  # two epochs in one fit
        two = _weights(straight, straight_model)
        again = make_trainer(make(), devices, FEATURE, "", **epochs(2))
        resumed = _model(shards)
        again.fit(resumed, ckpt_path=ckpt)
        back = _weights(again, resumed)
        # the same resume from a copy without the optimiser state must land elsewhere (else
        # this check could not see a strategy that drops the momentum)
        _write_blank(ckpt, blank)
        cold = make_trainer(make(), devices, FEATURE, "", **epochs(2))
        fresh = _model(shards)
        cold.fit(fresh, ckpt_path=blank)
        cold_weights = _weights(cold, fresh)
    except Exception as err:  # the test names the strategy and the message
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
    finite = all(np.isfinite(v).all() for w in (fitted, two, back) for v in w.values())
    return {
        "step": checkpoint["global_step"],  # (a fork launch does not hand it back)
        "moved": _change_ratio(initial, mine),
        "checkpoint": _largest(saved, fitted),
        "eval_changed": _largest(evaluated, mine),
        "resume_gap": _largest(back, two),
        "resume_moved": _largest(back, fitted),
        "cold_gap": _largest(cold_weights, two),
        "finite": finite,
    }


def _write_blank(ckpt: str, path: str) -> None:
    """``ckpt`` without its optimiser state, written once (rank 0) for every rank."""
    distributed = dist.is_initialized()
    if not distributed or dist.get_rank() == 0:
        blank = torch.load(ckpt, map_location="cpu", weights_only=False)
        for state in blank["optimizer_states"]:
            state["state"] = {}
        torch.save(blank, path)
    if distributed:
        dist.barrier()


def _change_ratio(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> float:
    """``|after - before| / |before|`` over every parameter, Lightning's ``change_ratio``."""
    keys = [k for k in before if k in after and after[k].shape == before[k].shape]
    if not keys:
        return 0.0
    a = np.concatenate([before[k].ravel() for k in keys])
    b = np.concatenate([after[k].ravel() for k in keys])
    return float(np.linalg.norm(b - a) / np.linalg.norm(a))


def run_models_on_rank(rank: int, world: int, names: list[str], tmp: str) -> dict:
    """``run_on_ranks`` entry: every strategy of ``names`` in turn, in the same ranks."""
    return {name: run_model(name, os.path.join(tmp, name)) for name in names}
