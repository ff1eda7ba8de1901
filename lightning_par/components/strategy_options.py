"""The keyword options every lightning_par strategy takes, checked before anything starts.

A typo (``num_server=2``) or a torch DDP option that means nothing here
(``find_unused_parameters``) is a ``TypeError`` naming every option the strategy accepts,
raised in the constructor: no process starts (the project's rule for bad input).
"""

from __future__ import annotations

import inspect
from typing import Any

from lightning.pytorch.strategies import DDPStrategy

from lightning_par.launch.policy import START_METHODS

#: Arguments Lightning's accelerator connector may pass to any strategy.
PLUMBING_ARGUMENTS = (
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
)


def option_names(cls: type) -> list[str]:
    """Every keyword strategy class ``cls`` takes (its constructors' up to Lightning's)."""
    names = []
    for klass in cls.__mro__:
        if klass is DDPStrategy:
            break
        for name, p in inspect.signature(klass.__init__).parameters.items():
            if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD:
                if name != "self" and name not in names:
                    names.append(name)
    return names + list(PLUMBING_ARGUMENTS)


def plumbing_arguments(given: dict[str, Any]) -> dict[str, Any]:
    """The arguments in ``given`` that Lightning's ``DDPStrategy`` takes from its connector."""
    return {name: given[name] for name in PLUMBING_ARGUMENTS if name in given}


def check_options(
    cls: type, given: dict[str, Any], start_method: Any, trace: Any, dead_peer_timeout: Any = None
) -> None:
    """Refuse unknown keywords, an unknown start method, a ``trace`` that is not a bool and a
    ``dead_peer_timeout`` that is not a number of seconds above zero."""
    unknown = sorted(set(given) - set(PLUMBING_ARGUMENTS))
    if unknown:
        raise TypeError(
            f"{cls.__name__} got unknown option(s) {unknown}; it accepts "
            f"{', '.join(option_names(cls))} (torch DDP options do not apply: there is "
            "no DistributedDataParallel wrapper)"
        )
    if start_method is not None and start_method not in START_METHODS:
        raise ValueError(f"start_method={start_method!r}: choose one of {START_METHODS}")
    if not isinstance(trace, bool):
        raise TypeError(f"trace must be True or False, got {trace!r}")
    if dead_peer_timeout is not None and (
        isinstance(dead_peer_timeout, bool)
        or not isinstance(dead_peer_timeout, (int, float))
        or not dead_peer_timeout > 0
    ):
        raise ValueError(
            f"dead_peer_timeout must be a number of seconds > 0 (how long a rank may stop "
            f"responding before the job ends), got {dead_peer_timeout!r}"
        )
