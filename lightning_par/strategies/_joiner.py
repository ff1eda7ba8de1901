"""A replacement joining a running ``fit`` (``fault_tolerant=True``): Lightning's side.

The protocol and the group are :mod:`lightning_par.components.rejoin`'s. What Lightning
needs of it:

* the training state travels as a checkpoint (:func:`state_for_joiner`: Lightning's
  ``dump_checkpoint`` on the leading member, at the start of the step the joiner joins at),
  and the joiner's ``fit`` restores it as it restores one read from a ``ckpt_path``
  (:func:`restore_in_joiner`): weights, optimiser and scheduler states, the loops'
  counters, the callbacks' states. The hyper-parameters stay behind (the joiner's script
  built its model with its own); a state holding a type ``torch.load(weights_only=True)``
  refuses is not restored, and the joiner withdraws, saying so;
* the joiner's training loader reads the shard of the member whose place it took, from the
  batch the members are at (:class:`ResumedSampler`): Lightning restores the counters of a
  checkpoint saved mid-epoch but reads a plain loader from its start again.
"""

from __future__ import annotations

import io
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_par import _compat
from lightning_par.strategies._carry_back import SCRIPT_KEYS, dump_rank_checkpoint


class ResumedSampler(DistributedSampler):
    """Lightning's ``DistributedSampler`` whose first epoch read starts at ``resume_at``
    (``(epoch, sample)``); its length, and every later epoch, are the sampler's."""

    resume_at: tuple[int, int] | None = None

    def __iter__(self) -> Any:
        if self.resume_at is None:
            return super().__iter__()
        epoch, start = self.resume_at
        self.resume_at = None
        self.set_epoch(epoch)  # (Lightning sets it after its first read of a restored fit)
        return iter(list(super().__iter__())[start:])


def resume_at(loader: Any, epoch: int, batch: int) -> None:
    """Make ``loader`` (a ``DataLoader`` over Lightning's ``DistributedSampler``) read its
    shard in ``epoch`` from batch ``batch`` on, the first time it is read."""
    if not isinstance(loader, DataLoader) or type(loader.sampler) is not DistributedSampler:
        raise ValueError(
            "a replacement joins a running fit with one DataLoader over Lightning's "
            f"DistributedSampler as its training loader; this run has a {type(loader).__name__}"
        )
    loader.sampler.__class__ = ResumedSampler
    loader.sampler.resume_at = (epoch, batch * (loader.batch_size or 1))


def state_for_joiner(trainer: pl.Trainer) -> bytes:
    """The training state as ``torch.save`` writes it (the leading member, at a step's
    start: every step before it done, none of it begun)."""
    checkpoint = dump_rank_checkpoint(trainer)
    kept = {k: v for k, v in checkpoint.items() if k not in SCRIPT_KEYS or k == "state_dict"}
    buffer = io.BytesIO()
    torch.save(kept, buffer)
    return buffer.getvalue()


def restore_in_joiner(trainer: pl.Trainer, state: bytes) -> None:
    """The joiner's running ``fit`` restores ``state`` (``torch.load`` refuses any object
    but tensors and plain values: ``weights_only``)."""
    checkpoint = torch.load(io.BytesIO(state), map_location="cpu", weights_only=True)
    _compat.preload_checkpoint(trainer, checkpoint)


def extras_for_joiner(trainer: pl.Trainer) -> dict[str, Any]:
    """What the joiner's Lightning takes from the leader besides the state: the loggers'
    versions (a logger computes its own from the folders it finds) and the loggers' step."""
    loggers = [lg for lg in trainer.loggers if _compat.logger_version_field(lg)]
    return {
        "versions": [lg.version for lg in loggers],
        "stepped": _compat.batches_that_stepped(trainer),
    }


def take_extras(trainer: pl.Trainer, extras: dict[str, Any]) -> None:
    """In the joiner, once Lightning restored the state: the leader's logger versions."""
    loggers = [lg for lg in trainer.loggers if _compat.logger_version_field(lg)]
    for logger, version in zip(loggers, extras.get("versions", [])):
        setattr(logger, _compat.logger_version_field(logger), version)
