"""The user's optimizer stepping on this rank's shard of every parameter (ZeRO's P_os).

An optimizer whose update is element-wise (SGD, Adam, AdamW, RMSprop, Adagrad, ...) computes
each element of a parameter from the same element of its gradient and state, so stepping a
slice gives that slice of the whole step, bit for bit. :class:`ShardedOptimizer` keeps the
user's optimizer object (learning-rate schedulers hold it) and swaps each parameter group's
list for the pieces of its parameters that fall in this rank's shards
(:class:`~lightning_par.zero.units.Piece`): small ``nn.Parameter`` views of the shard, so the
step writes straight into it. Hyper-parameters stay per group, so weight decay on some
parameters only still means what it means.

One whose update looks at whole tensors (LBFGS's line search, Adafactor's factored second
moment, Muon's orthogonalisation) is refused by name. The state converts to and from one
process's ``state_dict`` format, so checkpoints load anywhere.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_par.collectives import ring_all_gather, ring_allreduce
from lightning_par.comm import Communicator
from lightning_par.zero.units import FlatUnit, Piece

#: torch's optimizers whose update is element-wise.
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad",
               "Adadelta", "ASGD", "Rprop")  # fmt: skip
#: Optimizers known to need whole tensors, and why.
WHOLE_TENSOR = {
    "LBFGS": "its line search re-evaluates the whole loss and mixes every element",
    "Adafactor": "it factors each matrix's second moment into row and column sums",
    "Muon": "it orthogonalises each whole weight matrix",
    "SparseAdam": "it steps sparse gradients",
}


def check_elementwise(optimizer: Any, who: str, allowed: Iterable[type] = ()) -> None:
    """Refuse an optimizer whose update is not known to be element-wise."""
    inner = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer's
    cls = type(inner)
    if cls.__name__ in ELEMENTWISE and cls.__module__.startswith("torch.optim"):
        return
    if any(issubclass(cls, a) for a in allowed):
        return
    reason = WHOLE_TENSOR.get(cls.__name__)
    if reason is not None:
        raise ValueError(
            f"{who} steps each rank's slice of every parameter, so it needs an optimizer "
            f"whose update is element-wise; {cls.__name__} is not: {reason}. Use an "
            "element-wise one (SGD, Adam, AdamW, RMSprop, Adagrad, ...) or a strategy that "
            "keeps whole parameters (ring_allreduce)"
        )
    raise ValueError(
        f"{who} steps each rank's slice of every parameter, so it needs an optimizer whose "
        f"update is element-wise; it does not know {cls.__module__}.{cls.__name__}. If its "
        "update is element-wise (each element from that element's gradient and state only), "
        f"pass {who.split()[0]}(elementwise_optimizers=[{cls.__name__}]); otherwise use a "
        "strategy that keeps whole parameters (ring_allreduce)"
    )


class ShardedOptimizer:
    """``optimizer`` (the user's) made to step the pieces of ``units`` this rank holds."""

    def __init__(self, optimizer: torch.optim.Optimizer, units: list[FlatUnit]) -> None:
        self.optimizer = optimizer
        self.units = units
        self.where = {id(p): (u, i) for u in units for i, p in enumerate(u.params)}
        #: each group's original parameter list (one process's state_dict numbering)
        self.original = [list(g["params"]) for g in optimizer.param_groups]
        missing = [p for ps in self.original for p in ps if id(p) not in self.where]
        if missing:
            raise ValueError(
                f"{len(missing)} parameter(s) of the optimizer are not trainable parameters "
                "of the model; zero shards only the model's parameters"
            )
        #: per unit: (piece, its nn.Parameter view of the shard) for this rank
        self.pieces: dict[int, list[tuple[Piece, nn.Parameter]]] = {}
        for unit in units:
            self.pieces[unit.index] = [
                (pc, nn.Parameter(unit.shard[pc.shard_start : pc.shard_start + pc.numel]))
                for pc in unit.pieces
            ]
        self._swap_in()

    def _swap_in(self) -> None:
        for group, params in zip(self.optimizer.param_groups, self.original):
            group["params"] = [piece for p in params for piece in self.pieces_of(p)]

    def pieces_of(self, param: nn.Parameter) -> list[nn.Parameter]:
        unit, i = self.where[id(param)]
        return [view for pc, view in self.pieces[unit.index] if pc.index == i]

    # ---- gradients --------------------------------------------------------------------------
    def set_gradients(self, unit: FlatUnit, grads: torch.Tensor, used: list[bool]) -> None:
        """Give this rank's pieces of ``unit`` their gradients: slices of ``grads`` (the
        unit's shard of gradients), or None where no rank had the parameter's gradient."""
        for pc, view in self.pieces[unit.index]:
            if used[pc.index]:
                view.grad = grads[pc.shard_start : pc.shard_start + pc.numel]
            else:
                view.grad = None

    def set_gradients_from_parameters(self) -> None:
        """Stage 1: the pieces' gradients are slices of the (averaged) whole gradients."""
        for unit in self.units:
            for pc, view in self.pieces[unit.index]:
                grad = unit.params[pc.index].grad
                view.grad = None if grad is None else grad.detach().reshape(-1)[pc.start : pc.stop]

    def piece_parameters(self) -> list[nn.Parameter]:
        return [view for pieces in self.pieces.values() for _, view in pieces]

    # ---- one process's state_dict ---------------------------------------------------------
    def full_state_dict(self, comm: Communicator) -> dict[str, Any]:
        """The optimizer's ``state_dict`` as one process holding every parameter would give
        it (every rank must call this: the shards' states are all-gathered)."""
        state: dict[int, dict[str, Any]] = {}
        numbering = {id(p): n for n, p in enumerate(p for ps in self.original for p in ps)}
        kinds = self._state_kinds()
        for unit in self.units:
            for key, shaped in kinds.items():
                self._gather_key(unit, key, shaped, comm, state, numbering)
        groups = []
        for group, params in zip(self.optimizer.param_groups, self.original):
            entry = {k: v for k, v in group.items() if k != "params"}
            entry["params"] = [numbering[id(p)] for p in params]
            groups.append(entry)
        return {"state": state, "param_groups": groups}

    def _state_kinds(self) -> dict[str, bool]:
        """Every state key the optimizer keeps, and whether it is shaped like the parameter
        (else a scalar such as Adam's ``step``): one step of the same class on a one-element
        parameter, per group (no rank needs another's answer)."""
        kinds: dict[str, bool] = {}
        cls = type(self.optimizer)
        accepted = inspect.signature(cls).parameters
        for group in self.optimizer.param_groups:
            probe = nn.Parameter(torch.zeros(2))
            probe.grad = torch.ones(2)
            options = {k: v for k, v in group.items() if k != "params" and k in accepted}
            for k in ("foreach", "fused", "capturable"):
                options.pop(k, None)
            one = cls([probe], **options)
            one.step()
            for key, value in one.state[probe].items():
                kinds[key] = isinstance(value, torch.Tensor) and value.shape == probe.shape
        return kinds

    def _gather_key(self, unit, key, shaped, comm, state, numbering) -> None:
        opt_state = self.optimizer.state
        p = unit.world_size
        # which parameters were ever stepped, and their scalar values (by the first piece),
        # on the unit's device: NCCL sends no CPU tensor
        has = torch.zeros(len(unit.params), dtype=torch.float64, device=unit.device)
        scalars = torch.zeros(len(unit.params), dtype=torch.float64, device=unit.device)
        buffer = (
            torch.zeros(unit.padded_numel, dtype=unit.dtype, device=unit.device) if shaped else None
        )
        lo = unit.rank * unit.shard_numel
        for pc, view in self.pieces[unit.index]:
            value = opt_state.get(view, {}).get(key)
            if value is None:
                continue
            has[pc.index] = 1
            if shaped:
                buffer[lo + pc.shard_start : lo + pc.shard_start + pc.numel] = value
            elif pc.start == 0:
                scalars[pc.index] = float(value)
        if p > 1:
            flags = torch.cat([has, scalars])
            ring_allreduce(flags, comm=comm)
            has, scalars = flags[: len(has)], flags[len(has) :]
            if shaped:
                ring_all_gather(buffer, comm=comm)
        for i, param in enumerate(unit.params):
            if has[i] == 0:
                continue
            entry = state.setdefault(numbering[id(param)], {})
            if shaped:
                start, n = unit.offsets[i], unit.numels[i]
                entry[key] = buffer[start : start + n].view_as(param).clone()
            else:
                entry[key] = torch.tensor(scalars[i].item(), dtype=torch.float32)

    def load_full_state_dict(self, full: dict[str, Any]) -> None:
        """Load one process's ``state_dict``: this rank keeps its pieces' slices."""
        numbering = [p for ps in self.original for p in ps]
        self.optimizer.state.clear()
        for n, values in full["state"].items():
            param = numbering[int(n)]
            for view, pc in self._views_of(param):
                piece_state = self.optimizer.state[view]
                for key, value in values.items():
                    shaped = isinstance(value, torch.Tensor) and value.shape == param.shape
                    if shaped:
                        flat = value.reshape(-1)[pc.start : pc.stop]
                        piece_state[key] = flat.to(view.device, view.dtype).clone()
                    else:
                        piece_state[key] = (
                            value.clone() if isinstance(value, torch.Tensor) else value
                        )
        for group, saved in zip(self.optimizer.param_groups, full["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def _views_of(self, param: nn.Parameter) -> list[tuple[nn.Parameter, Piece]]:
        unit, i = self.where[id(param)]
        return [(view, pc) for pc, view in self.pieces[unit.index] if pc.index == i]

    def restore(self, comm: Communicator) -> None:
        """Give the optimizer back its whole parameters and one process's state (every rank
        calls this: the state is all-gathered)."""
        full = self.full_state_dict(comm)
        for group, params in zip(self.optimizer.param_groups, self.original):
            group["params"] = params
        self.optimizer.state.clear()
        if full["state"]:
            self.optimizer.load_state_dict(full)
