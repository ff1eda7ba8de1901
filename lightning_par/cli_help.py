"""Help text a user reads: what ``lightning-par`` is, the strategy names one types, and each
strategy's own options.

jsonargparse builds a class's help from its ``__init__`` and follows ``**kwargs`` into the
parent classes, so a strategy built on Lightning's ``DDPStrategy`` would list some 25 torch
DDP options (``ddp_comm_hook``, ``static_graph``, ...) that do not apply to it. Here a
strategy's options are the parameters of the ``__init__`` of each class in its method
resolution order that belongs to this package, stopping at the first class that does not:
whatever Lightning's classes take is plumbing Lightning's connector fills in. The rule reads
only signatures and docstrings, so it holds however the strategy classes are composed.
Descriptions come from the Google-style ``Args:`` sections of those classes' docstrings.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import re
import textwrap
from typing import Any

from lightning_par.cli_checks import lightning_strategy_names, our_strategy_names

HELP_FLAG = "--trainer.strategy.help"


def description() -> str:
    """What ``lightning-par --help`` says before its options."""
    return (
        "lightning_par: PyTorch Lightning strategies that teach and run the classic ways to "
        "parallelise training (allreduce data parallelism, parameter servers, asynchronous "
        "and local SGD, pipeline, layer-wise, tensor and hybrid parallelism). `fit` trains a "
        "model (CifarCNN by default) on CIFAR-10 with --trainer.strategy=NAME, where NAME is "
        f"one of {', '.join(our_strategy_names())} or a Lightning strategy. `fit --help` "
        f"lists every option, `fit {HELP_FLAG} NAME` one strategy's."
    )


def plain(text: str) -> str:
    """Docstring text without Sphinx markup, for a terminal: a role such as ``:func:`` keeps
    its target (only the last name after a tilde), and double backquotes become single ones,
    as Markdown writes code."""

    def role(m: re.Match) -> str:
        return m[2].split(".")[-1] if m[1] else m[2]

    text = re.sub(r":[a-z]+:`(~?)([^`<]*?)(?:\s*<[^>]*>)?`", role, text)
    return text.replace("``", "`")


class DefaultsFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse help that shows every option's default (``store_true`` flags excepted), also
    of options without a help text, and keeps the description's own line breaks."""

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and action.nargs != 0 and action.default is not None:
            action = copy.copy(action)
            action.help = ""  # argparse formats no help line for an empty help: give one
            action.help = self._get_help_string(action).strip() or None
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        fresh = "(default:" not in text
        if fresh and default not in (None, False, argparse.SUPPRESS) and action.nargs != 0:
            shown = " ".join(map(str, default)) if isinstance(default, list) else default
            text += f" (default: {shown})"
        return text


def strategy_names_help() -> str:
    """The text of ``--trainer.strategy`` in ``fit --help``: names, not class paths."""
    lightning = [n for n in lightning_strategy_names() if "find_unused_parameters" not in n]
    return (
        f"A strategy name. lightning_par: {', '.join(our_strategy_names())}. Lightning: "
        f"{', '.join(lightning)}. Or a class path with options "
        "(--trainer.strategy=GPipeStrategy --trainer.strategy.chunks=8). "
        f"`{HELP_FLAG} NAME` lists a strategy's options."
    )


def resolve_strategy(value: str) -> tuple[type, dict[str, Any]] | None:
    """A registered name, a class name or a class path -> (class, registered defaults)."""
    from lightning.pytorch.strategies import StrategyRegistry

    if value in StrategyRegistry:
        entry = StrategyRegistry[value]
        return entry["strategy"], dict(entry.get("init_params", {}))
    for name in StrategyRegistry.available_strategies():
        cls = StrategyRegistry[name]["strategy"]
        if value in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}"):
            return cls, {}
    return None


def cli_option_names(cls: type) -> list[str]:
    """The options jsonargparse accepts for strategy class ``cls`` (it reads signatures and
    what ``**kwargs`` is passed to by name: a keyword a class fixes itself is not one)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "s")
    names = {a.dest[2:] for a in parser._actions if a.dest.startswith("s.")}
    return sorted(names - {"help"})


def own_options(cls: type) -> list[tuple[inspect.Parameter, str]]:
    """(parameter, description) of every option the strategy class itself declares and
    the command line accepts (parameter_server fixes ``process_group_backend`` to gloo)."""
    options: list[tuple[inspect.Parameter, str]] = []
    seen: set[str] = set()
    accepted = set(cli_option_names(cls))
    for klass in cls.__mro__:
        if not klass.__module__.startswith("lightning_par"):
            break  # Lightning's own classes: plumbing the Trainer fills in
        if "__init__" not in vars(klass):
            continue
        docs = _arg_docs(klass)
        for name, p in inspect.signature(klass.__init__).parameters.items():
            if name in seen or name not in accepted:
                continue
            seen.add(name)
            options.append((p, docs.get(name, "")))
    return options


def _arg_docs(klass: type) -> dict[str, str]:
    """``name -> description`` from the ``Args:`` sections of a class and its ``__init__``."""
    found: dict[str, str] = {}
    for doc in (klass.__doc__, vars(klass)["__init__"].__doc__):
        text = inspect.cleandoc(doc or "")
        section = re.search(r"^(?:Args|Arguments|Parameters):\n((?:[ \t]+.*\n?|\n)+)", text, re.M)
        if not section:
            continue
        for m in re.finditer(r"^ {2,8}(\w+)(?: \([^)]*\))?: (.*(?:\n {6,}.*)*)", section[1], re.M):
            found.setdefault(m[1], plain(" ".join(m[2].split())))
    return found


def strategy_help(value: str, prog: str) -> str | None:
    """The help of one strategy, or ``None`` to leave it to jsonargparse (a class that is not
    this package's, or a name no registry knows)."""
    resolved = resolve_strategy(value)
    if resolved is None or not resolved[0].__module__.startswith("lightning_par"):
        return None
    cls, registered = resolved
    title = (inspect.getdoc(cls) or "").split("\n\n")[0]
    lines = [
        f"usage: {prog} fit --trainer.strategy={cls.__name__} "
        "[--trainer.strategy.OPTION=VALUE ...]",
        "",
        f"{value}: {cls.__module__}.{cls.__qualname__}",
        textwrap.fill(plain(" ".join(title.split())), 88),
        "",
        "options:",
    ]
    for p, doc in own_options(cls):
        default = registered.get(p.name, p.default)
        kind = "" if p.annotation is p.empty else _annotation(p.annotation)
        head = f"  --trainer.strategy.{p.name}" + (f" ({kind})" if kind else "")
        shown = "required" if default is p.empty else f"default: {default!r}"
        body = f"{doc} ({shown})" if doc else f"({shown})"
        lines += [head, textwrap.fill(body, 88, initial_indent=" " * 8, subsequent_indent=" " * 8)]
    return "\n".join(lines) + "\n"


def _annotation(annotation: Any) -> str:
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    return text.replace("typing.", "")


def with_class_path(argv: list[str], value: str) -> list[str]:
    """``argv`` with a strategy *name* after ``--trainer.strategy.help`` replaced by its class
    path, which is what jsonargparse's help of a class expects (``ddp`` -> DDPStrategy)."""
    resolved = resolve_strategy(value)
    if resolved is None:
        return argv
    path = f"{resolved[0].__module__}.{resolved[0].__qualname__}"
    out = []
    for arg in argv:
        if arg == value:
            arg = path
        elif arg == f"{HELP_FLAG}={value}":
            arg = f"{HELP_FLAG}={path}"
        out.append(arg)
    return out


def requested_strategy_help(argv: list[str]) -> str | None:
    """The value of ``--trainer.strategy.help`` in ``argv`` (``X`` or ``=X``), if any."""
    for i, arg in enumerate(argv):
        if arg == HELP_FLAG and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(HELP_FLAG + "="):
            return arg.split("=", 1)[1]
    return None
