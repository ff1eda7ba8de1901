"""Strategy options on the ``lightning-par`` command line and in a YAML config, and their
errors as one usage line.

``--trainer.strategy=GPipeStrategy --trainer.strategy.chunks=2`` (or ``class_path`` and
``init_args`` in YAML) is jsonargparse's: it reads the constructor's signature. Its errors
are a dozen lines about ``Union`` subtypes; here they become one line that names the
option as typed: a misspelt option with its close match, a value the constructor refused
with the constructor's own message. A registered name with options
(``--trainer.strategy=gpipe --trainer.strategy.chunks=2``) is rewritten to its class plus
the name's registered options, which jsonargparse cannot do (a name is a plain string).
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from lightning_par.cli_checks import close_match
from lightning_par.cli_help import HELP_FLAG, cli_option_names, own_options, resolve_strategy
from lightning_par.strategies import strategy_specs

PREFIX = "--trainer.strategy"


def strategy_class(path: str) -> type | None:
    """The strategy class a jsonargparse ``class_path`` names (any import path of it)."""
    resolved = resolve_strategy(path)
    if resolved is not None:
        return resolved[0]
    module, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name, None) if module else None
    except ImportError:
        return None
    return found if isinstance(found, type) else None


def unknown_option_error(message: str) -> str | None:
    """jsonargparse's "Option 'chunkz' is not accepted" for a strategy class, as one line."""
    found = re.search(r"class_path '([\w.]+)'.*?'(\w+)' is not (?:accepted|expected)", message,
                      re.S)  # fmt: skip
    cls = strategy_class(found[1]) if found else None
    if cls is None:
        return None
    option = found[2]
    names = cli_option_names(cls)
    line = f"{PREFIX}.{option} is not an option of {cls.__name__}."
    match = close_match(option, names)
    if match:
        line += f" Did you mean {PREFIX}.{match}?"
    return f"{line} Its options: {', '.join(names)} (`{HELP_FLAG} {cls.__name__}`)."


def constructor_error(strategy: Any) -> str | None:
    """Build the strategy of a parsed config again to get the message its constructor
    raised (jsonargparse keeps only its own summary), naming the option as typed."""
    path = getattr(strategy, "class_path", None)
    cls = strategy_class(path) if isinstance(path, str) else None
    if cls is None:
        return None
    options = dict(vars(strategy.init_args)) if strategy.init_args is not None else {}
    try:
        cls(**options)
    except (ValueError, TypeError) as err:
        message = " ".join(str(err).split())
        named = _named_option(cls, options, message)
        typed = f"{PREFIX}.{named}={_shown(options[named])}: " if named else ""
        return f"{typed}{cls.__name__}: {message}"
    return None


def _named_option(cls: type, options: dict[str, Any], message: str) -> str | None:
    """The option given a value other than its default that ``message`` mentions first."""
    defaults = {p.name: p.default for p, _ in own_options(cls)}
    places = {}
    for name, value in options.items():
        found = re.search(rf"\b{name}\b", message)
        if found and (name not in defaults or defaults[name] != value):
            places[name] = found.start()
    return min(places, key=places.__getitem__, default=None)


def _shown(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def with_registered_class(argv: list[str]) -> list[str]:
    """``--trainer.strategy=NAME`` followed by options ``--trainer.strategy.OPTION``, NAME
    one of ours, becomes the class with the name's registered options (the user's win)."""
    specs = {s.name: s for s in strategy_specs()}
    has_options = any(a.startswith(f"{PREFIX}.") and not a.startswith(HELP_FLAG) for a in argv)
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg, name = argv[i], None
        if arg.startswith(f"{PREFIX}="):
            name = arg.split("=", 1)[1]
        elif arg == PREFIX and i + 1 < len(argv):
            name, i = argv[i + 1], i + 1
        spec = specs.get(name) if has_options and name else None
        if spec is None:
            out.append(arg if name is None or arg != PREFIX else f"{PREFIX}={name}")
        else:
            out.append(f"{PREFIX}={spec.cls.__module__}.{spec.cls.__qualname__}")
            out += [f"{PREFIX}.{k}={_shown(v)}" for k, v in spec.options.items()]
        i += 1
    return out
