"""Tensor (intra-layer) parallelism as a Lightning strategy: each layer's weight cut across
the devices (Megatron-LM, Shoeybi et al., 2019, arXiv:1909.08053).

Every rank reads the same batches (no distributed sampler; checked every step by one small
allreduce, so an unseeded shuffle under popen fails loudly) and holds a slice of each split
layer: :func:`lightning_par.tensorparallel.parallelize` cuts ``module.<module_attr>`` by the
automatic plan (column -> row pairs of consecutive Linear/Conv2d layers, LSTMs by hidden
units) or the user's ``plan``, after every rank has taken rank 0's weights. The operators
``f``/``g`` keep every activation exact, and the layers left whole get the same gradient on
every rank, so there is nothing to synchronise after backward and the weights after k steps
are one process's.

Checkpoints hold the full model and the optimiser state in one process's own format
(assembled on rank 0): they load without this strategy, and a checkpoint of any plugin
resumes under it. Refused before launch: a plan that cannot be cut exactly, a model with
nothing to cut, a
gradient scaler (its skip-on-inf decision would be per rank), ``sync_batchnorm``, dropout
(a mask per rank), and an allreduce algorithm whose ranks could sum in different orders.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_par.collectives import broadcast_parameters
from lightning_par.comm import Communicator
from lightning_par.pipeline.state import gather_objects
from lightning_par.strategies._base import ParStrategy
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

#: Allreduces that leave the very same bits on every rank (one rank sums each chunk and the
#: result is copied), so the layers kept whole stay identical across ranks.
EXACT_ALGORITHMS = ("ring", "tree")


class TensorParallelStrategy(ParStrategy):
    """Megatron-style tensor parallelism over all the devices.

    Args:
        plan: module name (as in ``module.named_modules()``) -> ``"column"``, ``"row"``,
            ``"column_gather"`` or ``"lstm"``; ``None``: the automatic plan of
            ``module.<module_attr>`` (see :mod:`lightning_par.tensorparallel.plan`).
        module_attr: the attribute the automatic plan searches.
        algorithm: the allreduce of ``f`` and ``g``, ``"ring"`` or ``"tree"``.
        **kwargs: ``trace``, ``trace_dir``, ``start_method``, ``process_group_backend``,
            ``timeout``: see :class:`~lightning_par.strategies._base.ParStrategy`.
    """

    strategy_name = "tensor_parallel"
    shards_data = False

    def __init__(
        self,
        plan: Mapping[str, str] | None = None,
        module_attr: str = "net",
        algorithm: str = "ring",
        **kwargs: Any,
    ) -> None:
        if algorithm not in EXACT_ALGORITHMS:
            raise ValueError(
                f"tensor_parallel: algorithm={algorithm!r} is not supported; choose one of "
                f"{EXACT_ALGORITHMS} (their ranks all get the same bits, which keeps the "
                "layers left whole identical on every rank)"
            )
        if plan is not None and not isinstance(plan, Mapping):
            raise TypeError(f"tensor_parallel: plan must be a dict of name -> style, got {plan!r}")
        super().__init__(**kwargs)
        self.plan, self.module_attr, self.algorithm = plan, module_attr, algorithm
        self.tp_plan: Plan | None = None

    @classmethod
    def compare_bytes_per_step(cls, model: Any, devices: int, global_batch: int,
                               options: Mapping[str, Any]) -> list[int]:  # fmt: skip
        """Bytes each rank sends per training step (for ``python -m lightning_par.compare``):
        :func:`~lightning_par.tensorparallel.cost.step_cost` of the plan on a batch of
        ``global_batch`` CIFAR images (or ``model.example_input_array``'s shape)."""
        from lightning_par.tensorparallel.cost import step_cost

        plan = resolve_plan(model, devices, options.get("plan"), options.get("module_attr", "net"))
        sample = getattr(model, "example_input_array", None)
        if not isinstance(sample, torch.Tensor):
            sample = torch.zeros(global_batch, 3, 32, 32)
        algorithm = options.get("algorithm", "ring")
        return list(step_cost(model, plan, sample, algorithm=algorithm).bytes_sent)

    # ---- the ranks a layer is split over ----------------------------------------------------
    @property
    def tp_size(self) -> int:
        """Ranks each layer is split over: every process (the hybrid strategy: its
        model-parallel degree)."""
        return self.num_processes * self.num_nodes

    @property
    def tp_comm(self) -> Communicator | None:
        """Their communicator (the hybrid strategy: one model-parallel group of its grid);
        ``None`` before setup."""
        return self.comm

    @property
    def tp_rank(self) -> int:
        return self.tp_comm.rank if self.tp_comm is not None else self.global_rank

    # ---- before launch ---------------------------------------------------------------------
    def check_before_launch(self, trainer: pl.Trainer | None = None) -> None:
        """Refuse what would not train exactly as one process, before any rank starts."""
        module = self.lightning_module
        if module is None or module_shards(module):
            return
        world = self.tp_size
        plan = resolve_plan(module, world, self.plan, self.module_attr)
        if not plan.cuts:
            why = "; ".join(f"{k}: {v}" for k, v in plan.replicated.items()) or "no layers"
            raise ValueError(
                f"tensor_parallel: nothing in `{type(module).__name__}.{self.module_attr}` can "
                f"be split over {world} devices ({why}); pass plan={{name: style}} or use "
                "fewer devices"
            )
        check_no_dropout(module)
        if trainer is not None:
            check_trainer(trainer, self.precision_plugin)

    # ---- splitting the model ---------------------------------------------------------------
    def prepare_model(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        if module_shards(module):  # already split (validate or test after fit)
            return
        check_trainer(trainer, self.precision_plugin)
        assert self.tp_comm is not None
        # Every rank cuts its slice of rank 0's weights (popen ranks built their own).
        broadcast_parameters(module, self.tp_comm)
        group = TPGroup(self.tp_comm, self.algorithm)
        self.tp_plan = parallelize(module, group, self.plan, root=self.module_attr)
        rank_zero_info(f"tensor_parallel plan over {self.tp_size} ranks:\n  "
                       + self.tp_plan.describe().replace("\n", "\n  "))  # fmt: skip

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:  # Lightning's clipping calls this by norm
            self.precision_plugin.clip_grad_by_norm = self._clip_by_whole_norm

    def _clip_by_whole_norm(self, optimizer: Any, clip_val: float) -> None:
        """Clip by the norm of the whole model's gradient, not of this rank's slices."""
        assert self.comm is not None
        module = self.lightning_module
        shards = module_shards(module)
        split = {id(p) for name, p in module.named_parameters() if name in shards}
        params = list(self.precision_plugin.main_params(optimizer))
        clip_grad_norm_split([p for p in params if id(p) in split],
                             [p for p in params if id(p) not in split], float(clip_val),
                             TPGroup(self.comm, self.algorithm))  # fmt: skip

    # ---- every rank must train on the same batch --------------------------------------------
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        group = self.tp_comm.group if self.tp_comm is not None else None
        check_same_batch(batch, self.root_device, group)
        return super().training_step(*args, **kwargs)

    # ---- checkpoints: one process's format -------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full model's state dict on rank 0 (every rank takes part)."""
        local = self.lightning_module.state_dict()
        shards = module_shards(self.lightning_module)
        if self.tp_comm is None or not shards:
            return local
        mine = {k: v for k, v in local.items() if k in shards}
        states = gather_objects(self.tp_comm, mine, self.root_device)
        if states is None:
            return local
        return {**local, **assemble_state_dict(states, shards)}

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        shards = module_shards(self.lightning_module)
        state = shard_state_dict(checkpoint["state_dict"], shards, self.tp_rank)
        self.lightning_module.load_state_dict(state, strict=strict)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        local = super().optimizer_state(optimizer)
        if self.tp_comm is None or not module_shards(self.lightning_module):
            return local
        states = gather_objects(self.tp_comm, local, self.root_device)
        if states is None:
            return {}
        return assemble_optimizer_state(states, self._shards_of(optimizer))

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            local = shard_optimizer_state(state, self._shards_of(optimizer), self.tp_rank)
            optimizer.load_state_dict(local)

    def _shards_of(self, optimizer: Any) -> list:
        inner = getattr(optimizer, "optimizer", optimizer)  # Lightning's wrapper
        return parameter_shards(self.lightning_module, inner)


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


def check_no_dropout(module: torch.nn.Module) -> None:
    """Reject dropout: each rank would draw its own mask (on a replicated activation the
    ranks part ways; on a split one the masks are not one process's)."""
    for name, layer in module.named_modules():
        if isinstance(layer, torch.nn.modules.dropout._DropoutNd) and layer.p > 0:
            raise ValueError(
                f"tensor_parallel: {name} ({type(layer).__name__}, p={layer.p}) would draw a "
                "different mask on every rank; remove dropout or set p=0"
            )


def check_trainer(trainer: pl.Trainer, precision_plugin: Any) -> None:
    """Reject trainer settings under which the split model would differ from one process."""
    if getattr(precision_plugin, "scaler", None) is not None:
        raise ValueError(
            "tensor_parallel: a gradient scaler (precision='16-mixed') skips a step on each "
            "rank's own inf check, so ranks could part ways; use precision='bf16-mixed' or 32"
        )
    if trainer.strategy._layer_sync is not None:  # Trainer(sync_batchnorm=True)
        raise ValueError(
            "tensor_parallel: sync_batchnorm would average statistics over ranks that all see "
            "the same batch (split BatchNorms are per channel already); remove sync_batchnorm"
        )


__all__ = ["EXACT_ALGORITHMS", "TensorParallelStrategy", "check_no_dropout", "check_trainer"]
