"""Parameters that become trainable after setup (an unfrozen layer, a new param group, as
Lightning's ``BackboneFinetuning`` does): a strategy whose synchronisation was fixed at
setup must not let them train silently unsynchronised. The allreduce strategies average
them (:meth:`~lightning_par.strategies.allreduce.AllReduceStrategy.post_backward`); the
parameter servers, whose shards were planned at setup, stop at the first step that has a
gradient for one (:func:`refuse_late_parameters`)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


def late_parameters(module: nn.Module, known: Iterable[nn.Parameter]) -> list[str]:
    """Names of ``module``'s parameters with a gradient that are not among ``known``."""
    ids = {id(p) for p in known}
    return [n for n, p in module.named_parameters() if p.grad is not None and id(p) not in ids]


def refuse_late_parameters(module: nn.Module, known: Iterable[nn.Parameter], name: str) -> None:
    """Raise naming the parameters that became trainable after the servers were set up."""
    late = late_parameters(module, known)
    if late:
        raise RuntimeError(
            f"{name}: parameter(s) {late} became trainable after setup (an unfrozen layer or "
            "a new param group), but the servers hold only the parameters trainable when fit "
            "started, so they would never be updated. Make them trainable (and put them in "
            "the optimiser) before fit, or use an allreduce strategy, which synchronises them"
        )
