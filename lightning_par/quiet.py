"""Silence Lightning's known noise, message by message, in our CLI, check, bench and course.

Every fit and test used to print a notice about tensorboardX, two advertising tips
(litlogger, litmodels), torch's ``LeafSpec is deprecated`` warning raised inside
Lightning's own code, and the ``DistributedSampler ... trainer.test()`` advice (the sampler's
padding counts at most ``processes - 1`` test images twice). None of them asks the
user to do anything. :func:`quiet_lightning` filters exactly these messages: any other
warning or log line still appears.

Filters are process state: ranks started by fork inherit them, ranks started as new
processes (popen) re-run the CLI, which calls :func:`quiet_lightning` first.
"""

from __future__ import annotations

import logging
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


def quiet_lightning() -> None:
    """Install the filters; calling it again changes nothing."""
    for pattern, category in NOISY_WARNINGS:
        # filterwarnings drops an identical earlier entry first, so repeats do not pile up.
        warnings.filterwarnings("ignore", message=pattern, category=category)
    for name in RANK_ZERO_LOGGERS:
        logging.getLogger(name).addFilter(_LOG_FILTER)  # no-op if already there
