"""Lightning's collectives among the workers only, for strategies with server processes.

The parameter servers join the workers' process group (every message between a worker
and a server travels in it) but never run Lightning's loop, so every collective Lightning
makes on the default group would wait for them forever. :class:`WorkerGroupMixin` sends
Lightning's ``barrier``, ``broadcast``, ``reduce``, ``all_gather``, the start-up weight
broadcast, torchmetrics' syncs, the barrier around ``prepare_data`` and the per-step
SIGTERM flag over ``worker_group`` (ranks ``0 .. W-1``) instead.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torchmetrics import Metric

from lightning_par import _compat
from lightning_par.comm import CommError
from lightning_par.paramserver.faults import explain
from lightning_par.paramserver.protocol import IDLE_TIMEOUT


def check_positive(name: str, value: Any, kind: type = float) -> None:
    """``value`` is a number (an int if ``kind`` is int) above zero, or a clear error."""
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise TypeError(
            f"{name} must be {'a number' if kind is float else 'an int'}, got {value!r}"
        )
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")


class WorkersBarrier:
    """Lightning's barrier around ``prepare_data`` (one rank may download for a long time),
    over the workers' group and with the servers' idle timeout."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __enter__(self) -> WorkersBarrier:
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.monitored_barrier(group=self.group, timeout=IDLE_TIMEOUT)


class WorkerGroupMixin:
    """Lightning's collectives over ``self.worker_group`` (put before the strategy base)."""

    worker_group: Any = None

    def prepare_data_among_workers(self) -> None:
        """Lightning brackets ``prepare_data`` with a barrier in a new group of every rank,
        servers included, which never join it (a hang): here the barrier is the workers'."""
        trainer = _compat.attached_trainer(self.lightning_module)
        if trainer is None:
            return
        group = self.worker_group
        _compat.barrier_around_prepare_data(trainer, lambda: WorkersBarrier(group))

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if dist.is_initialized():
            dist.barrier(group=self.worker_group)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=self.worker_group)
        return box[0]

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        return super().reduce(tensor, group=group or self.worker_group, reduce_op=reduce_op)

    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False):
        return super().all_gather(tensor, group=group or self.worker_group, sync_grads=sync_grads)

    def sync_model_states(self) -> None:
        assert self.model is not None
        for sub in self.model.modules():  # torchmetrics sync on the default group otherwise
            if isinstance(sub, Metric):
                sub.process_group = self.worker_group
        with torch.no_grad():
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                dist.broadcast(tensor.data, 0, group=self.worker_group)

    def broadcast_sigterm(self) -> None:
        """Lightning's per-step SIGTERM flag from worker 0, among the workers only."""
        trainer = self.lightning_module.trainer
        flag = torch.tensor([int(bool(getattr(trainer, "received_sigterm", False)))])
        try:
            dist.broadcast(flag, 0, group=self.worker_group)
        except RuntimeError as err:
            raise CommError(explain(
                f"worker {self.global_rank}: the workers' per-step broadcast (from worker 0) "
                f"failed: a worker hangs or died ({err})"
            )) from err  # fmt: skip
        if flag.item() == 1:
            dist.barrier(group=self.worker_group)
            raise SIGTERMException()
