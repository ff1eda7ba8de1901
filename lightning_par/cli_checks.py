"""Checks of the values typed on the ``lightning-par`` command line (or in its YAML config).

Each bad value becomes one :class:`UsageError`: what is wrong, the valid choices (ours
first), a close match when there is one. The CLI prints it and exits with code 2 before any
process starts, instead of a traceback from deep inside Lightning.
"""

from __future__ import annotations

import difflib
import textwrap
from collections.abc import Iterable, Sequence
from typing import Any

import lightning_par.models as models
from lightning_par.models.classifier import OPTIMIZERS, SCHEDULERS
from lightning_par.strategies import strategy_specs


class UsageError(Exception):
    """A value the user typed is invalid; the message says which, and what would work."""


def our_strategy_names() -> list[str]:
    """The strategy names lightning_par registers, in registry order (the reference last)."""
    return [spec.name for spec in strategy_specs()]


def lightning_strategy_names() -> list[str]:
    """Lightning's own strategy names (``auto`` included), ours left out."""
    from lightning.pytorch.strategies import StrategyRegistry

    ours = set(our_strategy_names())
    return ["auto"] + [n for n in StrategyRegistry.available_strategies() if n not in ours]


def accelerator_names() -> list[str]:
    from lightning.pytorch.accelerators import AcceleratorRegistry

    return [
        "auto",
        "cpu",
        "gpu",
        *sorted(set(AcceleratorRegistry.available_accelerators()) - {"cpu"}),
    ]


def model_names() -> list[str]:
    """Short class names ``--model`` accepts: every ImageClassifier subclass imported."""
    found, todo = [], list(models.ImageClassifier.__subclasses__())
    while todo:
        cls = todo.pop(0)
        found.append(cls.__name__)
        todo += cls.__subclasses__()
    return found


def shown(value: Any) -> str:
    """A value as the user would type it on the command line."""
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def close_match(value: str, choices: Iterable[str]) -> str | None:
    matches = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6)
    return matches[0] if matches else None


def _wrap(label: str, names: Sequence[str]) -> str:
    return textwrap.fill(
        ", ".join(names), width=100, initial_indent=f"  {label}: ", subsequent_indent="    "
    )


def unknown_choice(option: str, value: str, what: str, groups: dict[str, Sequence[str]]) -> str:
    """``--option='value' is not a <what>. Did you mean ...?`` and one line per group."""
    match = close_match(value, [n for names in groups.values() for n in names])
    head = f"{option}={shown(value)} is not {what}."
    if match:
        head += f" Did you mean {option}={match}?"
    return "\n".join([head, *(_wrap(label, names) for label, names in groups.items())])


def strategy_error(value: str) -> str:
    lightning = [n for n in lightning_strategy_names() if "find_unused_parameters" not in n]
    return unknown_choice(
        "--trainer.strategy",
        value,
        "a strategy name",
        {
            "lightning_par": our_strategy_names(),
            "Lightning": lightning + ["(ddp* also with _find_unused_parameters_true/_false)"],
        },
    )


# -- numbers ----------------------------------------------------------------------------
def _int_value(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def check_at_least(option: str, value: Any, low: int, note: str = "") -> None:
    """An integer ``>= low``; ``None`` (unset) passes."""
    if value is None:
        return
    number = _int_value(value)
    if number is not None and number >= low:
        return
    message = f"{option}={shown(value)} must be an integer >= {low}{note}."
    if number is not None and number < 0 and -number >= low:
        message += f" Did you mean {option}={-number}?"
    raise UsageError(message)


def check_float(option: str, value: Any, low: float, strict: bool = False) -> None:
    """A number ``>= low`` (``> low`` when ``strict``); ``None`` (unset) passes."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return  # a type jsonargparse already checked
    if value > low or (value == low and not strict):
        return
    message = f"{option}={shown(value)} must be {'>' if strict else '>='} {shown(low)}."
    if value < 0 and -value > low:
        message += f" Did you mean {option}={shown(-value)}?"
    raise UsageError(message)


def check_devices(value: Any, accelerator: Any) -> None:
    """A count (>= 1, or -1 for all), ``auto``, or GPU indices (``0,1`` or ``[0, 1]``)."""
    number = _int_value(value)
    if value == "auto" or (number is not None and (number >= 1 or number == -1)):
        return
    indices = value if isinstance(value, (list, tuple)) else None
    if isinstance(value, str) and "," in value:
        indices = [_int_value(v) for v in value.split(",") if v.strip()]
    if indices and all(_int_value(i) is not None and _int_value(i) >= 0 for i in indices):
        if accelerator != "cpu":
            return
        raise UsageError(
            f"--trainer.devices={shown(value)}: on CPU devices is a number of processes, "
            f"e.g. --trainer.devices={len(indices)}."
        )
    message = (
        f"--trainer.devices={shown(value)} is not a device count: give a number of processes >= 1, "
        "-1 for all devices, 'auto', or GPU indices such as 0,1."
    )
    if number is not None and number < -1:
        message += f" Did you mean --trainer.devices={-number}?"
    raise UsageError(message)


def check_limit(option: str, value: Any) -> None:
    """``limit_*_batches``: a batch count >= 0 or a fraction in [0, 1]."""
    if value is None:
        return
    if isinstance(value, float):
        # jsonargparse reads "2" as 2.0 here; Lightning takes a whole float > 1 as a count.
        if 0.0 <= value <= 1.0 or (value > 1 and value.is_integer()):
            return
    elif (number := _int_value(value)) is not None and number >= 0:
        return
    raise UsageError(f"{option}={shown(value)} must be a batch count >= 0 or a fraction in [0, 1].")


def _get(ns: Any, key: str, default: Any = None) -> Any:
    try:
        return ns.get(key, default) if ns is not None else default
    except (AttributeError, KeyError, TypeError):
        return default


def check_config(cfg: Any) -> None:
    """Check a subcommand's parsed configuration (jsonargparse ``Namespace``)."""
    from lightning_par.data import SOURCES  # slow: the data package loads torchvision

    trainer = _get(cfg, "trainer")
    strategy = _get(trainer, "strategy")
    if (
        isinstance(strategy, str)
        and strategy not in our_strategy_names() + lightning_strategy_names()
    ):
        raise UsageError(strategy_error(strategy))
    accelerator = _get(trainer, "accelerator")
    if isinstance(accelerator, str) and accelerator not in accelerator_names():
        raise UsageError(
            unknown_choice(
                "--trainer.accelerator",
                accelerator,
                "an accelerator",
                {"choices": accelerator_names()},
            )  # fmt: skip
        )
    if _get(trainer, "devices") is not None:
        check_devices(_get(trainer, "devices"), accelerator)
    for key, low, note in (
        ("max_epochs", -1, " (-1: no limit)"),
        ("min_epochs", 0, ""),
        ("max_steps", -1, " (-1: no limit)"),
        ("min_steps", 0, ""),
        ("num_nodes", 1, ""),
        ("accumulate_grad_batches", 1, ""),
        ("check_val_every_n_epoch", 1, ""),
        ("num_sanity_val_steps", -1, " (-1: all)"),
    ):
        check_at_least(f"--trainer.{key}", _get(trainer, key), low, note)
    for stage in ("train", "val", "test", "predict"):
        key = f"limit_{stage}_batches"
        check_limit(f"--trainer.{key}", _get(trainer, key))
    check_float("--trainer.gradient_clip_val", _get(trainer, "gradient_clip_val"), 0)

    data = _get(cfg, "data")
    source = _get(data, "source")
    if isinstance(source, str) and source not in SOURCES:
        raise UsageError(
            unknown_choice("--data.source", source, "a data source", {"choices": list(SOURCES)})
        )
    for key, low in (("batch_size", 1), ("num_workers", 0), ("synthetic_size", 1)):
        check_at_least(f"--data.{key}", _get(data, key), low)
    check_float("--data.val_size", _get(data, "val_size"), 0)

    model_args = _get(_get(cfg, "model"), "init_args")
    check_float("--model.lr", _get(model_args, "lr"), 0, strict=True)
    for key in ("momentum", "weight_decay"):
        check_float(f"--model.{key}", _get(model_args, key), 0)
    for key, choices in (("optimizer", OPTIMIZERS), ("scheduler", SCHEDULERS)):
        value = _get(model_args, key)
        if isinstance(value, str) and value not in choices:
            names = [str(c) for c in choices]
            raise UsageError(
                unknown_choice(f"--model.{key}", value, f"an {key}", {"choices": names})
            )


def check_argv(argv: Sequence[str]) -> None:
    """Checks that must run before jsonargparse parses ``argv``: a ``--model`` it cannot
    resolve would otherwise end in its whole usage text and a nested type error."""
    for i, arg in enumerate(argv):
        if arg == "--model" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--model="):
            value = arg.split("=", 1)[1]
        else:
            continue
        # A class path, a YAML/JSON file or inline config is jsonargparse's to resolve.
        if any(c in value for c in "./{:") or not value:
            continue
        if value not in model_names():
            raise UsageError(
                unknown_choice("--model", value, "a model", {"choices": model_names()})
                + "\n  (or a class path such as my_package.MyModel)"
            )
