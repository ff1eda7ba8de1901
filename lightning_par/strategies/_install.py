"""Installing hooks written once in another module on a strategy class, where a mixin would
add a third class of ours above Lightning's (ARCHITECTURE.md): :mod:`._split_hooks` on
``ParStrategy``, :mod:`._ps_hooks` on the parameter-server strategies."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from typing_extensions import override


def install_hooks(cls: type, hooks: Mapping[str, Any], by: str, ours: Collection[str] = ()) -> None:
    """Set each of ``hooks`` (name -> function or property) on ``cls``: afterwards a plain
    method of ``cls``, named as one and marked ``@override`` (all but the names in ``ours``,
    which are not Lightning's). A hook ``cls`` writes itself is refused, naming ``by``."""
    for name, hook in hooks.items():
        if name in vars(cls):
            raise TypeError(f"{cls.__name__}.{name} is installed by {by}")
        func = hook.fget if isinstance(hook, property) else hook
        func.__qualname__ = f"{cls.__qualname__}.{name}"
        func.__module__ = cls.__module__
        if name not in ours:
            override(func)  # a Lightning hook
        setattr(cls, name, hook)
