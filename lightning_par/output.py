"""Lines a user reads during a fit: printed so they never land glued to a progress bar, with
sizes a person reads (KiB, MiB), and our own warnings without a source path.

Lightning's tqdm progress bar redraws its line in place; a bare ``print`` in the middle of
an epoch continues that line (``Epoch 0:  28%|██▊ | 20/71 ... lightning_par estimate: ...``).
``tqdm.write`` clears the bars, prints the line and redraws them below it, which is what
Lightning's own ``TQDMProgressBar.print`` does when a bar is active
(https://github.com/tqdm/tqdm#writing-messages). Sizes use binary prefixes (IEC 80000-13:
1 KiB = 1024 B), as ``torch.cuda.memory_summary`` does.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parent


def format_bytes(count: float) -> str:
    """``512 B``, ``1.50 KiB``, ``10.6 MiB``, ``120 MiB``: three significant digits."""
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            break
        size /= 1024
    if unit == "B":
        return f"{int(size)} B"
    digits = 0 if abs(size) >= 100 else 1 if abs(size) >= 10 else 2
    return f"{size:.{digits}f} {unit}"


def say(trainer: Any, text: str) -> None:
    """Print ``text`` on its own line(s) above Lightning's progress bar, if one is shown."""
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

    bar = getattr(trainer, "progress_bar_callback", None)
    if isinstance(bar, TQDMProgressBar) and bar.is_enabled:
        from tqdm import tqdm

        tqdm.write(text, file=sys.stdout)
        sys.stdout.flush()
    elif isinstance(bar, RichProgressBar) and bar.is_enabled and bar.progress is not None:
        bar.print(text)
    else:
        print(text, flush=True)


_lightning_format = warnings.formatwarning


def _format_warning(message, category, filename, lineno, line=None) -> str:
    """Our own warnings as ``UserWarning: <message>``: the file and line inside this package
    say nothing to a user (the message says what happened and what to do)."""
    try:
        ours = Path(filename).resolve().is_relative_to(PACKAGE)
    except (OSError, ValueError):
        ours = False
    if ours:
        return f"{category.__name__}: {message}\n"
    return _lightning_format(message, category, filename, lineno, line)


def install_warning_format() -> None:
    """Show lightning_par's warnings without their source path (called on import)."""
    global _lightning_format
    if warnings.formatwarning is not _format_warning:
        _lightning_format = warnings.formatwarning
        warnings.formatwarning = _format_warning
