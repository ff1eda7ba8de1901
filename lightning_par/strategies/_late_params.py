"""Parameters that become trainable after setup (an unfrozen layer, a new param group, as
Lightning's ``BackboneFinetuning`` does): a strategy whose synchronisation was fixed at
setup must not let them train silently unsynchronised. The allreduce strategies average
them (:meth:`~lightning_par.strategies.allreduce.AllReduceStrategy.post_backward`); the
parameter servers, whose shards were planned at setup, stop before the first step that
would train one (:func:`refuse_late_parameters`), and refuse an optimiser holding frozen
parameters at setup (:func:`refuse_frozen_in_optimizer`)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


def late_parameters(module: nn.Module, known: Iterable[nn.Parameter]) -> list[str]:
    """Names of ``module``'s trainable parameters that are not among ``known``."""
    ids = {id(p) for p in known}
    return [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in ids]


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


def refuse_frozen_in_optimizer(module: nn.Module, optimizer: object, name: str) -> None:
    """Raise if the optimiser holds parameters that are frozen when fit starts: a plan made
    now would leave them out, and unfreezing them later would train nothing."""
    in_optimizer = {id(p) for g in getattr(optimizer, "param_groups", []) for p in g["params"]}
    frozen = [n for n, p in module.named_parameters()
              if id(p) in in_optimizer and not p.requires_grad]  # fmt: skip
    if frozen:
        raise ValueError(
            f"{name}: the optimiser holds parameter(s) {frozen} that are frozen "
            "(requires_grad=False) when fit starts; the servers hold only the parameters "
            "trainable at setup, so unfreezing them later would never update them. Unfreeze "
            "them before fit, or use an allreduce strategy, which synchronises parameters "
            "that become trainable later"
        )
