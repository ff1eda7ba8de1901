"""Lightning's ``ModelSummary``: its options and its table's rows (the CLI's whole-model
summary)."""

from __future__ import annotations

from typing import Any

from lightning_par._compat.lookup import require


def model_summary_options(callback: Any) -> tuple[int, dict[str, Any]]:
    """``(max_depth, summarize kwargs)`` of a Lightning ``ModelSummary`` callback."""
    for attr in ("_max_depth", "_summarize_kwargs"):
        require(callback, attr, f"ModelSummary.{attr}", "the whole-model summary of the CLI")
    return callback._max_depth, dict(callback._summarize_kwargs)


def summary_data(summary: Any) -> list[tuple[str, list[str]]]:
    """The table rows of a Lightning ``ModelSummary``."""
    require(summary, "_get_summary_data", "ModelSummary._get_summary_data",
             "the whole-model summary table")  # fmt: skip
    return summary._get_summary_data()
