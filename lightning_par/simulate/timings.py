"""What the scale-out times on this machine, kept with a validation's runs.

Two predictions time the model here while they are made: a pipeline stage's layers
(:func:`.stage_share.layer_weights`) and the busiest tensor-parallel rank's share
(:func:`.tp_share.busiest_share`). Timed again when ``--validate --reuse`` scores the same
runs later, they move with the load of that moment: rescoring one quiet run's folder while
tests ran beside it moved its tensor-parallel 2 -> 3 row from +6 to +11 %. So the first
scoring of a validation keeps each timing in its folder (:data:`FILE`), and every later one
reads it back: a folder scores the same every time.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

#: The timings a validation's folder keeps, by key.
FILE = "timings.json"

_kept: dict[str, float | list[float]] = {}
#: What forgets the values a caller cached from :func:`timed` (a ``functools.cache``'s clear).
_forget: list[Callable[[], None]] = []


def cached_from_here(clear: Callable[[], None]) -> None:
    """Register a cache of values read from :func:`timed`, cleared when timings are read."""
    _forget.append(clear)


def timed(key: str, measure: Callable[[], float | list[float]]) -> float | list[float]:
    """The timing ``key`` as kept, else ``measure()`` (kept from now on)."""
    if key not in _kept:
        _kept[key] = measure()
    return _kept[key]


def keep_in(folder: Path) -> Callable[[], None]:
    """Read the timings ``folder`` kept (none yet: every key is timed here); the function
    returned writes them back once scoring is done."""
    path = folder / FILE
    _kept.clear()
    for clear in _forget:
        clear()
    if path.exists():
        _kept.update(json.loads(path.read_text()))

    def write() -> None:
        path.write_text(json.dumps(_kept, indent=1, sort_keys=True))

    return write
