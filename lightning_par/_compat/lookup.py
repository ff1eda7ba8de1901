"""How every private name is reached: :func:`private` (a module's attribute), :func:`require`
(an object's), :func:`private_class` (a class to subclass); each raises :class:`CompatError`
naming the name, the versions lightning_par was written for and what depends on it."""

from __future__ import annotations

import importlib
from typing import Any

WRITTEN_FOR = "torch >= 2.4 and lightning >= 2.5, < 3"


class CompatError(RuntimeError):
    """A private Lightning/torch name lightning_par relies on is gone in this version."""


def moved(name: str, needed_by: str) -> CompatError:
    """The error for a private ``name`` that is gone, naming what ``needed_by`` it."""
    import lightning
    import torch

    return CompatError(
        f"{name} is missing in torch {torch.__version__} / lightning {lightning.__version__}; "
        f"lightning_par needs it for {needed_by} (written for {WRITTEN_FOR}). Install a "
        "supported version, or update lightning_par/_compat/"
    )


def private(module: str, name: str, needed_by: str) -> Any:
    """``module.name`` (a private attribute), or :class:`CompatError` if it has moved."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise moved(f"{module}.{name}", needed_by) from err


def require(obj: Any, attr: str, name: str, needed_by: str) -> None:
    """:class:`CompatError` unless ``obj`` has the private ``attr`` (``name`` in the error)."""
    if not hasattr(obj, attr):
        raise moved(name, needed_by)


def private_class(module: str, name: str, needed_by: str) -> type:
    """A private Lightning class to subclass; if it moved, a stand-in that raises
    :class:`CompatError` when it is used (so importing lightning_par still works)."""
    try:
        return private(module, name, needed_by)
    except CompatError:

        class Missing:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                raise moved(f"{module}.{name}", needed_by)

        Missing.__name__ = Missing.__qualname__ = name
        return Missing
