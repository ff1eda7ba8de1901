"""The tensor-parallel splitter: each layer's weight cut across the ranks (Megatron-LM,
Shoeybi et al., 2019, arXiv:1909.08053).

:class:`TensorParallelSplit` cuts ``module.<module_attr>`` by the automatic plan (column ->
row pairs of consecutive Linear/Conv2d layers, attention by heads, embeddings by
vocabulary, LSTMs by hidden units, :mod:`lightning_par.tensorparallel.plan`) or the user's
``plan``, after every rank has taken rank 0's weights and random state (dropout then draws
one process's masks). The operators ``f``/``g`` keep every activation exact, and the layers
left whole get the same gradient on every rank, so nothing is synchronised after backward.
Every rank reads the same batches (checked every step by one small allreduce). An optimiser
that reads the whole model or whole tensors (LBFGS, Adafactor, Muon) is refused at setup
(:mod:`.split_optimizers`); a layer whose weights are used at two places stays whole
(:mod:`lightning_par.tensorparallel.plan`). Checkpoints
hold the full model and one process's optimiser state, assembled on rank 0.

Used by ``tensor_parallel`` and the rows of ``hybrid(mp_kind="tensor_parallel")``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_par import _compat
from lightning_par.collectives import broadcast_parameters
from lightning_par.components.pipeline_inputs import capture_inputs
from lightning_par.components.split_optimizers import (
    WHOLE_MODEL,
    WHOLE_TENSOR,
    refuse_optimizers,
)
from lightning_par.components.splitter import ModelSplitter, find_network
from lightning_par.pipeline.state import gather_objects
from lightning_par.tensorparallel import (
    Plan,
    TPGroup,
    assemble_optimizer_state,
    assemble_state_dict,
    module_shards,
    parallelize,
    parameter_shards,
    resolve_plan,
    shard_optimizer_state,
    shard_state_dict,
)
from lightning_par.tensorparallel.clip import clip_grad_norm_split
from lightning_par.tensorparallel.plan import UNTRACED
from lightning_par.tensorparallel.random import share_random_state

#: Allreduces that leave the very same bits on every rank (one rank sums each chunk and the
#: result is copied), so the layers kept whole stay identical across ranks.
EXACT_ALGORITHMS = ("ring", "tree")


class TensorParallelSplit(ModelSplitter):
    """Megatron-style shards of ``module.<module_attr>`` over the ranks of ``split_comm``.

    Args:
        plan: module name -> ``"column"``, ``"row"``, ``"column_gather"`` or ``"lstm"``;
            ``None``: the automatic plan.
        module_attr: the attribute holding the network the plan cuts (``None``: ``net``, or
            the LightningModule's only child module with parameters).
        algorithm: the allreduce of ``f`` and ``g``, ``"ring"`` or ``"tree"``.
    """

    name = "tensor_parallel"

    def __init__(
        self, plan: Mapping[str, str] | None = None, module_attr: str | None = None,
        algorithm: str = "ring",
    ) -> None:  # fmt: skip
        super().__init__()
        if algorithm not in EXACT_ALGORITHMS:
            raise ValueError(
                f"tensor_parallel: algorithm={algorithm!r} is not supported; choose one of "
                f"{EXACT_ALGORITHMS} (their ranks all get the same bits, which keeps the "
                "layers left whole identical on every rank)"
            )
        if plan is not None and not isinstance(plan, Mapping):
            raise TypeError(f"tensor_parallel: plan must be a dict of name -> style, got {plan!r}")
        self.plan, self.module_attr, self.algorithm = plan, module_attr, algorithm
        self.tp_plan: Plan | None = None
        self._inputs: tuple | None = None

    @property
    def rank(self) -> int:
        comm = self.context.comm
        return comm.rank if comm is not None else self.context.rank

    @property
    def attr(self) -> str:
        """The LightningModule's attribute holding the network (``module_attr``, or found)."""
        return find_network(self.module, self.module_attr, "tensor_parallel")

    def _example(self, trainer: pl.Trainer | None) -> tuple | None:
        """A small batch of the network's inputs, to trace it for pairs outside any
        ``nn.Sequential`` (a ResNet block's convolutions): ``example_input_array`` before
        launch; in the ranks, without one, what the user's own step passes the network on
        the first batch (:func:`capture_inputs`: the network is not run, no random number
        drawn; every rank reads the same batch, and :meth:`split` checks the plans agree)."""
        if self._inputs is None:
            net = getattr(self.module, self.attr)
            try:
                args, _ = capture_inputs(self.module, net, trainer, "tensor_parallel")
            except ValueError:  # no example and no data yet: Sequential pairs only
                return None
            self._inputs = tuple(a[:2] if isinstance(a, torch.Tensor) and a.dim() else a
                                 for a in args)  # fmt: skip
        return self._inputs

    def check_before_launch(self, trainer: pl.Trainer | None) -> None:
        """Refuse what would not train exactly as one process, before any rank starts. A
        network whose layers lie outside any ``nn.Sequential`` (torchvision's ResNet) is
        left to the ranks when there is no ``example_input_array``: they trace the first
        batch, which the main process does not have."""
        self._check(trainer, self._example(None), in_ranks=False)

    def _check(self, trainer: pl.Trainer | None, example: tuple | None, in_ranks: bool) -> None:
        module = self.module
        if module is None or module_shards(module):
            return
        plan = resolve_plan(module, self.size, self.plan, self.attr, example)
        untraced = example is None and UNTRACED in plan.replicated.values()
        if not plan.cuts and (in_ranks or not untraced):
            why = "; ".join(f"{k}: {v}" for k, v in plan.replicated.items()) or "no layers"
            raise ValueError(
                f"tensor_parallel: nothing in `{type(module).__name__}.{self.attr}` can "
                f"be split over {self.size} devices ({why}); pass plan={{name: style}} or use "
                "fewer devices"
            )
        if trainer is not None:
            check_trainer(trainer, self.context.precision)

    def split(self, trainer: pl.Trainer) -> None:
        module = self.module
        if module_shards(module):  # already split (validate or test after fit)
            return
        check_trainer(trainer, self.context.precision)
        example = self._example(trainer)  # the first batch, to trace the network (uncut)
        self._check(trainer, example, in_ranks=True)  # torchrun/srun ranks skip the launcher
        # Every rank cuts its slice of rank 0's weights (popen ranks built their own).
        broadcast_parameters(module, self.comm)
        # ... and draws rank 0's random numbers: dropout masks as one process's (random.py)
        share_random_state(self.comm, self.context.root_device)
        group = TPGroup(self.comm, self.algorithm)
        plan = resolve_plan(module, self.size, self.plan, self.attr, example)
        check_same_plan(plan, self.context.root_device, self._group())
        self.tp_plan = parallelize(module, group, plan, root=self.attr)
        rank_zero_info(f"tensor_parallel plan over {self.size} ranks:\n  "
                       + self.tp_plan.describe().replace("\n", "\n  "))  # fmt: skip

    def after_setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            refused = {**WHOLE_MODEL, **WHOLE_TENSOR}
            holds = "its slices of the cut layers"
            refuse_optimizers(trainer.optimizers, self.context.name, holds, refused)
            # Lightning's clipping calls this by norm
            _compat.replace_clip_grad_by_norm(self.context.precision, self._clip_by_whole_norm)

    def _clip_by_whole_norm(self, optimizer: Any, clip_val: float) -> None:
        """Clip by the norm of the whole model's gradient, not of this rank's slices: summed
        over the ranks of one model (under ``hybrid`` one row: every replica holds the same
        averaged gradient, so summing over the whole grid would count it ``dp`` times)."""
        comm = self.comm
        module = self.module
        shards = module_shards(module)
        split = {id(p) for name, p in module.named_parameters() if name in shards}
        params = list(self.context.precision.main_params(optimizer))
        clip_grad_norm_split([p for p in params if id(p) in split],
                             [p for p in params if id(p) not in split], float(clip_val),
                             TPGroup(comm, self.algorithm))  # fmt: skip

    def _group(self) -> Any:
        """The process group of one model's ranks (``None``: every rank)."""
        comm = self.context.comm
        return comm.group if comm is not None else None

    def before_training_step(self, batch: Any) -> None:
        check_same_batch(batch, self.context.root_device, self._group())

    # ---- checkpoints: one process's format -------------------------------------------------
    def full_state_dict(self, local: dict[str, Any]) -> dict[str, Any]:
        """The full model's state dict on rank 0 (every rank takes part)."""
        shards = module_shards(self.module)
        if self.context.comm is None or not shards:
            return local
        mine = {k: v for k, v in local.items() if k in shards}
        states = gather_objects(self.comm, mine, self.context.root_device)
        if states is None:
            return local
        return {**local, **assemble_state_dict(states, shards)}

    def piece_state_dict(self, full: Mapping[str, Any]) -> Mapping[str, Any]:
        return shard_state_dict(full, module_shards(self.module), self.rank)

    def full_optimizer_state(self, local: dict[str, Any], optimizer: Any) -> dict[str, Any]:
        if self.context.comm is None or not module_shards(self.module):
            return local
        states = gather_objects(self.comm, local, self.context.root_device)
        if states is None:
            return {}
        return assemble_optimizer_state(states, self._shards_of(optimizer))

    def load_optimizer_states(self, optimizers: list[Any], states: list[Any]) -> bool:
        for optimizer, state in zip(optimizers, states):
            optimizer.load_state_dict(
                shard_optimizer_state(state, self._shards_of(optimizer), self.rank)
            )
        return True

    def _shards_of(self, optimizer: Any) -> list:
        inner = getattr(optimizer, "optimizer", optimizer)  # Lightning's wrapper
        return parameter_shards(self.module, inner)


def _signature(batch: Any) -> list[torch.Tensor]:
    """Per tensor of the batch: its size, sum, and a position-weighted sum (an order check)."""
    if isinstance(batch, dict):
        batch = list(batch.values())
    items = batch if isinstance(batch, (list, tuple)) else [batch]
    tensors = [t for t in items if isinstance(t, torch.Tensor)]
    out = []
    for t in tensors:
        rows = t.detach().double().reshape(t.shape[0], -1).sum(1) if t.dim() else t.double()[None]
        weights = torch.arange(1, rows.numel() + 1, dtype=torch.float64, device=rows.device)
        out += [torch.tensor(float(t.numel()), dtype=torch.float64, device=rows.device),
                rows.sum(), (rows * weights).sum()]  # fmt: skip
    return out


def check_same_batch(batch: Any, device: torch.device, group: Any = None) -> None:
    """Raise on every rank if the ranks got different batches (an unseeded shuffle or a
    sampler per rank under popen/torchrun): each rank would compute its slices of another
    batch and the run would end with weights no process would have. One allreduce of a few
    numbers per step, over ``group`` (default: every rank)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    sig = _signature(batch)
    if not sig:
        return
    local = torch.stack(sig).to(device)
    both = torch.cat([local, -local])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    high, low = both[: len(sig)], -both[len(sig) :]
    if not torch.allclose(high, low, rtol=1e-9, atol=1e-6):
        raise RuntimeError(
            "tensor_parallel: the ranks got different batches; every rank must read the same "
            "batches in the same order (seed the shuffle with DataLoader(generator=...) or "
            "seed_everything, and use no sampler that depends on the rank)"
        )


def check_same_plan(plan: Plan, device: torch.device, group: Any = None) -> None:
    """Raise on every rank if the ranks would cut the network differently (each traced its
    own first batch: one read another shape), before any collective of the cut layers
    could pair with another layer's. One allreduce of a digest of the plan."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    digest = hashlib.sha256(plan.describe().encode()).digest()[:7]  # (its negative fits)
    local = torch.tensor([int.from_bytes(digest, "little")], device=device)
    both = torch.cat([local, -local])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if int(both[0]) != -int(both[1]):
        raise RuntimeError(
            "tensor_parallel: the ranks made different plans from their first batches; every "
            "rank must read the same batches in the same order (seed the shuffle with "
            "DataLoader(generator=...) or seed_everything, and use no sampler that depends on "
            "the rank), or set the LightningModule's example_input_array"
        )


def check_trainer(trainer: pl.Trainer, precision_plugin: Any) -> None:
    """Reject trainer settings under which the split model would differ from one process."""
    if getattr(precision_plugin, "scaler", None) is not None:
        raise ValueError(
            "tensor_parallel: a gradient scaler (precision='16-mixed') skips a step on each "
            "rank's own inf check, so ranks could part ways; use precision='bf16-mixed' or 32"
        )
    if _compat.layer_sync(trainer.strategy) is not None:  # Trainer(sync_batchnorm=True)
        raise ValueError(
            "tensor_parallel: sync_batchnorm would average statistics over ranks that all see "
            "the same batch (split BatchNorms are per channel already); remove sync_batchnorm"
        )
