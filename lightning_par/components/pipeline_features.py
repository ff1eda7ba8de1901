"""What a model split into stages needs so that Lightning's everyday features mean what they
mean in one process (the splitters of :class:`~lightning_par.strategies.gpipe.GPipeStrategy`
and :class:`~lightning_par.strategies.layerwise.LayerwiseStrategy`: ``PipelineSplit`` and
``WavefrontSplit``):

* **clipping by norm** uses the whole model's norm: each stage adds up its gradients'
  squares, the stages sum them (one scalar allreduce) and every stage scales by the same
  coefficient (:func:`clip_grad_norm_across_stages`), as ``torch.nn.utils.clip_grad_norm_``
  does in one process;
* **one loss scale** under ``16-mixed``: the stages agree whether any of them found an
  inf/NaN gradient, so every stage skips (or takes) the same steps and their GradScalers
  stay equal (:func:`agree_on_overflow`);
* **the same batch on every stage**: checked once, on the first training batch, with a
  checksum (:func:`check_same_batch`); a user's sampler or an unseeded shuffle would
  otherwise pair stage 0's inputs with another batch's labels; and at least one sample per
  micro-batch (:func:`check_batch_size`);
* **BatchNorm** normalises each micro-batch on its own: :func:`warn_batchnorm` says so
  before launch (``deferred_batch_norm=True`` keeps the running statistics over the whole
  mini-batch: :mod:`lightning_par.pipeline.batchnorm`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_par import _compat


def clip_grad_norm_across_stages(
    stage_params: Iterable[torch.Tensor],
    max_norm: float,
    *,
    shared_params: Iterable[torch.Tensor] = (),
    count_shared: bool = True,
    group: Any = None,
) -> torch.Tensor:
    """Clip this stage's gradients by the norm of every stage's gradients together.

    ``shared_params`` (parameters every stage holds, e.g. owned by the LightningModule
    itself) count once, on the stage with ``count_shared``. Every stage of ``group`` must
    call this. Returns the total norm (as ``clip_grad_norm_``)."""
    stage = [p.grad for p in stage_params if p.grad is not None]
    shared = [p.grad for p in shared_params if p.grad is not None]
    counted = stage + (shared if count_shared else [])
    device = (stage or shared or [torch.zeros(())])[0].device
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for g in counted:
        squares += torch.linalg.vector_norm(g.detach().float(), 2) ** 2
    if dist.is_initialized():
        dist.all_reduce(squares, group=group)
    total = squares.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # clip_grad_norm_'s formula
    for g in stage + shared:
        g.detach().mul_(coef.to(g.dtype))
    return total


def agree_on_overflow(scaler: Any, group: Any = None) -> None:
    """Make ``scaler`` (a ``torch.amp.GradScaler``) find an inf/NaN whenever any stage
    does: after each ``unscale_`` the stages take the maximum of their found-inf flags, so
    all skip the same steps and update their scales alike (one loss scale for the model)."""
    if getattr(scaler, "_lightning_par_agrees", False):
        return
    original = scaler.unscale_

    def unscale_(optimizer: torch.optim.Optimizer) -> None:
        original(optimizer)
        found = _compat.scaler_found_inf(scaler, optimizer)
        flags = list(found.values())
        device = flags[0].device if flags else torch.device("cpu")
        any_inf = torch.zeros(1, dtype=torch.float32, device=device)
        for flag in flags:
            any_inf = torch.maximum(any_inf, flag.to(device).float().reshape(1))
        if dist.is_initialized():
            dist.all_reduce(any_inf, op=dist.ReduceOp.MAX, group=group)
        for flag in flags:
            flag.copy_(any_inf.reshape(flag.shape).to(flag.device, flag.dtype))
        if not flags and any_inf.item() > 0:  # no gradient here: let step() see it too
            found[device] = any_inf.reshape(())

    scaler.unscale_ = unscale_
    scaler._lightning_par_agrees = True


def clip_by_whole_model(precision_plugin: Any, clip: Callable[[Any, float], None]) -> None:
    """At setup for fitting: Lightning's clipping by norm calls ``clip`` (which uses every
    stage's gradients, :func:`clip_grad_norm_across_stages`), and a gradient scaler agrees
    with the other stages on overflows (:func:`agree_on_overflow`)."""
    _compat.replace_clip_grad_by_norm(precision_plugin, clip)
    scaler = getattr(precision_plugin, "scaler", None)
    if scaler is not None:
        agree_on_overflow(scaler)


def refuse_sync_batchnorm(sync_batchnorm: bool, who: str) -> None:
    """``Trainer(sync_batchnorm=True)`` has no meaning when every stage holds other layers."""
    if sync_batchnorm:
        raise ValueError(
            f"{who} refuses sync_batchnorm=True: it synchronises BatchNorm "
            "over data-parallel replicas, but every stage holds different layers and sees "
            "the same batch; remove sync_batchnorm"
        )


def empty_optimizer_error(who: str, rank: int, error: ValueError) -> ValueError | None:
    """A clear error for torch's "empty parameter list" on a stage without trainable
    parameters (None for any other error)."""
    if "empty parameter list" not in str(error):
        return None
    return ValueError(
        f"{who}: stage {rank} has no trainable parameters "
        "(all frozen) and configure_optimizers left them out, so its optimiser is "
        "empty: give the optimiser the frozen parameters too (self.parameters()), "
        "to unfreeze them later, or choose a balance=[...] that gives every stage a "
        "trainable layer"
    )


def check_batch_size(batch: Any, chunks: int, first_step: bool) -> None:
    """A batch needs a sample per micro-batch: refused on the first step (a setting to fix);
    later (a short last batch) it runs as fewer micro-batches, with a warning."""
    x = batch if isinstance(batch, torch.Tensor) else batch[0]
    if x.shape[0] >= chunks:
        return
    if first_step:
        raise ValueError(
            f"chunks={chunks} micro-batches but the batch has {x.shape[0]} samples: "
            f"use chunks <= batch size"
        )
    rank_zero_warn(f"a batch of {x.shape[0]} < chunks={chunks} samples runs as "
                   f"{x.shape[0]} micro-batches")  # fmt: skip


def batch_checksum(batch: Any) -> float:
    """A cheap fingerprint of every tensor in ``batch`` (sum and position-weighted sum)."""
    total = 0.0
    for t in _tensors(batch):
        flat = t.detach().reshape(-1).double()
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
        total += float(flat.sum()) + float((flat * weights).sum()) * 1e-3
    return total


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def check_same_batch(batch: Any, rank: int, world_size: int, strategy: str, group=None) -> None:
    """Raise on every stage if the stages' batches differ (every stage must call this)."""
    mine = batch_checksum(batch)
    sums: list[Any] = [None] * world_size
    dist.all_gather_object(sums, mine, group=group)
    differ = [s for s, other in enumerate(sums) if not _close(other, sums[0])]
    if differ:
        raise RuntimeError(
            f"{strategy}: pipeline stage(s) {differ} received a different first training batch "
            f"than stage 0 (checksums {sums}). Every stage must read the same batches in the "
            "same order: seed any shuffling (seed_everything, or a DataLoader generator) and "
            "use no per-rank sampler"
        )


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


def warn_batchnorm(net: nn.Module, chunks: int, strategy: str, deferred: bool = False) -> None:
    """Warn (before launch) that micro-batches change BatchNorm's statistics."""
    bn = [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bn or chunks <= 1:
        return
    running = (
        "its running statistics are kept over the whole mini-batch (deferred_batch_norm=True)"
        if deferred
        else "and updates the running statistics on its own (deferred_batch_norm=True keeps "
        "those over the whole mini-batch)"
    )
    rank_zero_warn(
        f"{strategy}: the network has {len(bn)} BatchNorm layer(s) and chunks={chunks}: each "
        f"micro-batch is normalised with its own statistics, {running}, so training differs "
        "from one process on the whole batch. Use GroupNorm/LayerNorm, or chunks=1, to "
        "train exactly as one process"
    )


def dropout_layers(net: nn.Module) -> list[str]:
    """The names of the layers of ``net`` that drop activations at random when training."""
    found = []
    for name, m in net.named_modules():
        rate = m.p if isinstance(m, nn.modules.dropout._DropoutNd) else getattr(m, "dropout", 0)
        if isinstance(m, (nn.modules.dropout._DropoutNd, nn.MultiheadAttention)) and rate:
            found.append(name or type(m).__name__)
    return found


def warn_dropout(net: nn.Module, strategy: str) -> None:
    """Warn (before launch) that a pipeline draws other dropout masks than one process."""
    layers = dropout_layers(net)
    if layers:
        shown = ", ".join(layers[:4]) + (", ..." if len(layers) > 4 else "")
        rank_zero_warn(
            f"{strategy}: the network drops activations at random ({shown}): each stage "
            "draws its masks on its own device, per micro-batch, so they are not the masks "
            "one process draws for the whole batch; training is still dropout training, but "
            "its weights equal one process's only with dropout off (tensor_parallel draws one "
            "process's masks)"
        )
