"""Every figure a notebook draws has a title, labelled axes (with units where the axis is a
time, a size or a rate) and a legend where colours mean something.

The course's test run (``course/conftest.py``) starts each notebook's kernel with an IPython
startup file that calls :func:`register`. From then on every figure is inspected when it is
shown: by ``plt.show()`` inside a cell, or by the inline backend at the cell's end. A figure
that lacks a part makes the cell fail with a message that names the figure and the part, so
the notebook's test run fails at that cell. A student's own kernel does not load it.

The rules follow Tufte's and the matplotlib guide's basics (a reader must be able to tell
what is plotted against what, in which unit, and which curve is which without the text):
https://matplotlib.org/stable/users/explain/quick_start.html#parts-of-a-figure
"""

from __future__ import annotations

import re
from typing import Any

#: An axis label that names one of these quantities must give its unit.
NEEDS_UNIT = re.compile(
    r"\b(time|latency|duration|wall|bandwidth|throughput|memory|bytes|traffic)\b", re.I
)
#: A ratio of two like quantities has no unit.
RATIO = re.compile(r"/|\bratio\b|\brelative\b|\bfraction\b|\bshare\b|\bspeed-?up\b", re.I)
#: What counts as a unit: a bracketed unit or a unit word/symbol.
UNIT = re.compile(
    r"(\(|\[)[^)\]]+(\)|\])|\b(s|ms|µs|us|ns|seconds?|B|KB|MB|GB|KiB|MiB|GiB|bytes|"
    r"steps?|units?|ticks?|floats?|elements?)\b"
)


def _has_data(ax: Any) -> bool:
    return bool(ax.lines or ax.collections or ax.images or ax.patches or ax.containers)


def _colours_with_meaning(ax: Any) -> int:
    """How many distinct colours the axes' lines and scatter/bar groups use."""
    colours: set[str] = set()
    for line in ax.lines:
        if len(line.get_xdata()) > 1 or line.get_marker() not in (None, "None", ""):
            colours.add(str(line.get_color()))
    for container in ax.containers:  # bar groups
        patches = list(getattr(container, "patches", []) or [])
        if patches:
            colours.add(str(patches[0].get_facecolor()))
    return len(colours)


def problems(fig: Any) -> list[str]:
    """What the figure lacks, one line each (empty: it is complete)."""
    found: list[str] = []
    suptitle = fig._suptitle.get_text() if getattr(fig, "_suptitle", None) else ""
    # small multiples that share their colours need one legend, on the figure or one panel
    figure_legend = bool(fig.legends) or any(a.get_legend() is not None for a in fig.axes)
    name = suptitle or next((a.get_title() for a in fig.axes if a.get_title()), "") or "untitled"
    for i, ax in enumerate(fig.axes):
        if not ax.get_visible() or not _has_data(ax) or ax.get_label() == "<colorbar>":
            continue
        where = f"figure {name!r}, axes {i}" + (f" {ax.get_title()!r}" if ax.get_title() else "")
        if not (ax.get_title() or suptitle):
            found.append(f"{where}: no title (set the axes title or the figure's suptitle)")
        if not ax.axison:
            continue  # a diagram or a picture: no axes to label
        for axis in ("x", "y"):
            group = getattr(ax, f"get_shared_{axis}_axes")().get_siblings(ax)  # ax included
            label = next((t for a in group if (t := getattr(a, f"get_{axis}label")())), "")
            categorical = any(
                t.get_text() and not _numeric(t.get_text())
                for a in group
                for t in getattr(a, f"get_{axis}ticklabels")()
            )
            if not label and not categorical:
                found.append(f"{where}: no {axis} label")
            elif (
                label
                and NEEDS_UNIT.search(label)
                and not (UNIT.search(label) or RATIO.search(label))
            ):
                found.append(f"{where}: the {axis} label {label!r} names no unit")
        if _colours_with_meaning(ax) > 1 and ax.get_legend() is None and not figure_legend:
            found.append(f"{where}: {_colours_with_meaning(ax)} colours but no legend")
    return found


def _numeric(text: str) -> bool:
    """Whether a tick label is a number (mathtext and a unicode minus allowed)."""
    plain = re.sub(r"[$\\{}%\s]|mathdefault", "", text).replace("−", "-").replace("^", "e")
    plain = plain.replace("10e", "1e") if plain.startswith("10e") else plain
    try:
        float(plain)
    except ValueError:
        return False
    return True


class FigureIncomplete(AssertionError):
    """A figure lacks a title, an axis label, a unit or a legend."""


def check_open_figures() -> None:
    """Raise :class:`FigureIncomplete` naming every open figure's missing parts."""
    import matplotlib.pyplot as plt

    missing = [line for num in plt.get_fignums() for line in problems(plt.figure(num))]
    if missing:
        raise FigureIncomplete("incomplete figure: " + "; ".join(missing))


def register(shell: Any) -> None:
    """Check every figure of this IPython kernel when it is shown (see the module doc)."""
    import sys

    pending: list[BaseException] = []

    def wrap_show() -> None:
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is None or getattr(pyplot.show, "_course_checked", False):
            return
        original = pyplot.show

        def show(*args: Any, **kwargs: Any) -> Any:
            check_open_figures()
            return original(*args, **kwargs)

        show._course_checked = True  # type: ignore[attr-defined]
        pyplot.show = show

    def before(*_: Any) -> None:
        wrap_show()

    def after_execute() -> None:  # runs before the inline backend shows and closes figures
        wrap_show()
        if "matplotlib.pyplot" in sys.modules:
            try:
                check_open_figures()
            except FigureIncomplete as error:
                pending.append(error)

    def after_cell(result: Any) -> None:
        if pending and result.error_in_exec is None:
            error = pending.pop()
            pending.clear()
            result.error_in_exec = error
            try:
                raise error
            except FigureIncomplete:
                shell.showtraceback()
        pending.clear()

    shell.events.register("pre_run_cell", before)
    shell.events.register("post_execute", after_execute)
    shell.events.register("post_run_cell", after_cell)
