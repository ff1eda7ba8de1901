"""Rank 0's share of a fault-tolerant run, taken over by the first survivor when rank 0 is
lost, where the job's store outlives it (a fork launch's store host, torchrun's agent, rank
0's keeper under SLURM: :mod:`lightning_par.launch.keeper`).

Lightning gives rank 0 alone the loggers' files, the checkpoints and its messages
(``rank_zero_only``, ``Strategy.is_global_zero``). Once rank 0 is lost:

* each survivor's ``rank_zero_only.rank`` becomes its rank among the survivors, and the
  strategy's ``is_global_zero`` is true on the first survivor (``Resilience.leads``), so
  ``save_checkpoint``, ``ModelCheckpoint`` and the loggers write from it. ``global_rank``
  keeps each process's first number (faults, traces and the shards are named by it);
* every logger keeps rank 0's version (:func:`share_versions`, as ``fit`` begins): a
  logger computes its version in each process from the folders it finds, so the first
  survivor would otherwise find rank 0's and write in the next;
* the first survivor logs the hyperparameters as rank 0 did when ``fit`` began, and keeps
  the rows rank 0 wrote to a ``CSVLogger``'s ``metrics.csv`` (Lightning's CSV writer
  deletes the file it finds when it is created).

Lost with rank 0: what it had not written yet, e.g. a ``CSVLogger``'s rows since its last
flush (every ``flush_logs_every_n_steps``, 100 by default).
"""

from __future__ import annotations

import csv
import os
import warnings
from typing import Any

from lightning.fabric.loggers.csv_logs import CSVLogger
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning_utilities.core.rank_zero import rank_zero_only

from lightning_par import _compat


def share_versions(trainer: Any) -> None:
    """As ``fit`` begins (every rank): each logger's version is rank 0's."""
    loggers = [lg for lg in trainer.loggers if _compat.logger_version_field(lg)]
    versions = trainer.strategy.broadcast([lg.version for lg in loggers])
    for logger, version in zip(loggers, versions):
        setattr(logger, _compat.logger_version_field(logger), version)


def lead_again(rank: int) -> None:
    """A later call in the same processes (``validate`` after ``fit``): Lightning's
    ``set_world_ranks`` gave ``rank_zero_only`` each process's first rank back; this
    survivor's ``rank`` among the survivors again, so the first one logs."""
    rank_zero_only.rank = rank


def take_over(trainer: Any, rank: int) -> None:
    """After a loss: this survivor's ``rank`` among the survivors; the first one takes over
    rank 0's share, if it did not have it (see the module docstring)."""
    leading = rank_zero_only.rank == 0
    rank_zero_only.rank = rank
    if rank != 0 or leading:
        return
    for logger in trainer.loggers:
        rows = _csv_rows(logger) if isinstance(logger, CSVLogger) else None
        with warnings.catch_warnings():  # ("... will be deleted": written back below)
            warnings.filterwarnings("ignore", "Experiment logs directory")
            experiment = logger.experiment  # (a dummy until now: created here)
        if rows is not None:
            _write_back(experiment, *rows)
    _compat.log_hyperparameters(trainer)


def _csv_rows(logger: CSVLogger) -> tuple[list[str], list[dict[str, str]]] | None:
    """The header and rows rank 0 wrote to ``logger``'s metrics file, if it did."""
    path = os.path.join(logger.log_dir, "metrics.csv")
    fs = get_filesystem(path)
    if not fs.isfile(path):
        return None
    with fs.open(path, "r", newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def _write_back(experiment: Any, keys: list[str], rows: list[dict[str, str]]) -> None:
    path = experiment.metrics_file_path
    with get_filesystem(path).open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    experiment.metrics_keys = sorted(set(experiment.metrics_keys) | set(keys))
