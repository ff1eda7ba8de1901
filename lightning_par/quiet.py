"""Silence Lightning's known noise, message by message, wherever lightning_par is imported.

Every fit and test used to print a notice about tensorboardX, two advertising tips
(litlogger, litmodels), torch's ``LeafSpec is deprecated`` warning raised inside
Lightning's own code, and the ``DistributedSampler ... trainer.test()`` advice (the sampler's
padding counts at most ``processes - 1`` test images twice). None of them asks the
user to do anything. :func:`quiet_lightning` filters exactly these messages: any other
warning or log line still appears.

Importing ``lightning_par`` calls :func:`quiet_lightning`, so a user's own script is as quiet
as the CLI; ``LIGHTNING_PAR_QUIET=0`` in the environment (read at import) or
``quiet_lightning(False)`` shows everything again. Filters are process state: ranks started
by fork inherit them, ranks started as new processes (popen) re-run the script, whose import
of ``lightning_par`` installs them again (and reads the same environment).

Benchmarks and the check print a report: :func:`quiet_report` also drops Lightning's
start-up lines ("GPU available", "`Trainer.fit` stopped", ...) and the warnings about
set-ups they choose on purpose (no validation loader, few loader workers, short epochs).
"""

from __future__ import annotations

import logging
import os
import warnings

#: (message regex, category) of each warning filtered; the regex matches the message start.
NOISY_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    (r"Starting from v1\.9\.0, `tensorboardX` has been removed", UserWarning),
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
    (
        r"Using `DistributedSampler` with the dataloaders\. During `trainer\.(test|validate)\(\)`",
        UserWarning,
    ),  # fmt: skip
)

#: Starts of the info lines filtered from Lightning's rank-zero loggers.
NOISY_LOG_STARTS: tuple[str, ...] = (
    "💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]",
    "💡 Tip: For seamless cloud uploads and versioning, try installing [litmodels]",
)

#: Loggers that ``rank_zero_info`` writes to (Lightning rebinds it on import).
RANK_ZERO_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "pytorch_lightning.utilities.rank_zero",
    "lightning_fabric.utilities.rank_zero",
    "lightning_utilities.core.rank_zero",
)


class _DropNoisyLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not message.startswith(NOISY_LOG_STARTS)


_LOG_FILTER = _DropNoisyLines()

#: Environment variable read when ``lightning_par`` is imported: ``0`` keeps every message.
QUIET_ENV = "LIGHTNING_PAR_QUIET"

#: Warnings about set-ups that benchmarks and the check choose on purpose.
REPORT_WARNINGS: tuple[str, ...] = (
    r"You defined a `validation_step` but have no `val_dataloader`",
    r"The '\w+_dataloader' does not have many workers",
    r"The number of training batches \(\d+\) is smaller than the logging interval",
)

#: Loggers whose info lines (accelerator, "`Trainer.fit` stopped", ...) a report drops.
LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric", "pytorch_lightning",
                     "lightning_fabric")  # fmt: skip


def quiet_lightning(on: bool = True) -> None:
    """Install the filters (``on=False``: take them away again); repeats change nothing."""
    # filterwarnings drops an identical earlier entry first, so repeats do not pile up; the
    # newest entry wins, so "default" (Python's own action) undoes "ignore".
    action = "ignore" if on else "default"
    for pattern, category in NOISY_WARNINGS:
        warnings.filterwarnings(action, message=pattern, category=category)
    for name in RANK_ZERO_LOGGERS:
        if on:
            logging.getLogger(name).addFilter(_LOG_FILTER)  # no-op if already there
        else:
            logging.getLogger(name).removeFilter(_LOG_FILTER)


def quiet_from_environment() -> bool:
    """What importing ``lightning_par`` does: quiet unless ``LIGHTNING_PAR_QUIET=0``."""
    on = os.environ.get(QUIET_ENV, "1").strip().lower() not in ("0", "false", "no", "off")
    if on:
        quiet_lightning()
    return on


def quiet_report() -> None:
    """For benchmarks and the check: :func:`quiet_lightning`, and no Lightning info lines
    or warnings about the set-ups they choose on purpose (other warnings still show)."""
    quiet_lightning()
    for pattern in REPORT_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    for name in LIGHTNING_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
