"""Lightning's collectives among the workers only, for strategies with server processes.

The parameter servers join the workers' process group (every message between a worker
and a server travels in it) but never run Lightning's loop, so every collective Lightning
makes on the default group would wait for them forever. :class:`WorkerGroup` (a component
the parameter-server strategies hold) runs Lightning's ``barrier``, ``broadcast``, the
start-up weight broadcast, torchmetrics' syncs, the barrier around ``prepare_data`` and the
per-step SIGTERM flag over the workers' group (ranks ``0 .. W-1``) instead; the strategy
passes :attr:`WorkerGroup.group` to Lightning's ``reduce`` and ``all_gather``. Between two
calls of a script that goes on in every worker (torchrun, ``popen``), the workers meet again
without the servers (:mod:`~lightning_par.components.workers_between_calls`).
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


def gloo_only(kwargs: dict[str, Any]) -> None:
    """Take ``process_group_backend`` out of ``kwargs``: only gloo (or unset) is allowed."""
    backend = kwargs.pop("process_group_backend", None)
    if backend not in (None, "gloo"):
        raise ValueError(
            f"process_group_backend={backend!r}: the parameter server talks to CPU servers "
            "over gloo (CUDA workers stage through pinned memory); leave it unset"
        )


class WorkersBarrier:
    """Lightning's barrier around ``prepare_data`` (one rank may download for a long time),
    over the workers' group and with the servers' idle timeout."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __enter__(self) -> WorkersBarrier:
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.monitored_barrier(group=self.group, timeout=IDLE_TIMEOUT)


class WorkerGroup:
    """Lightning's collectives over the workers' process group ``group`` (ranks ``0 .. W-1``
    of a group that also holds the servers)."""

    def __init__(self) -> None:
        self.group: Any = None
        self._metrics: list[Metric] = []  # the model's, syncing over ``group``
        #: the group's workers after a loss (``regroup``); a broadcast's ``src`` is an index
        #: into it, so that worker 0's broadcasts come from the first survivor once it is lost
        self.members: list[int] | None = None

    def _source(self, src: int) -> int:
        return src if self.members is None else self.members[src]

    def create(self, workers: int) -> None:
        """Make the workers' group (every rank of the default group must call this)."""
        self.group, self.members = dist.new_group(list(range(workers))), None

    def regroup(self, survivors: list[int]) -> None:
        """The workers' group holds ``survivors`` from now (``fault_tolerant``, a worker
        lost; only they call this), torchmetrics' syncs at the epoch's end included: on the
        old group they would wait for the lost worker."""
        self.group = dist.new_group(survivors, use_local_synchronization=True)
        self.members = list(survivors)
        for metric in self._metrics:
            metric.process_group = self.group

    def prepare_data(self, module: Any) -> None:
        """Lightning brackets ``prepare_data`` with a barrier in a new group of every rank,
        servers included, which never join it (a hang): here the barrier is the workers'."""
        trainer = _compat.attached_trainer(module)
        if trainer is None:
            return
        group = self.group
        _compat.barrier_around_prepare_data(trainer, lambda: WorkersBarrier(group))

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(group=self.group)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, self._source(src), group=self.group)
        return box[0]

    def sync_model_states(self, model: torch.nn.Module) -> None:
        """Worker 0's weights to every worker; torchmetrics sync among the workers."""
        # torchmetrics sync on the default group otherwise
        self._metrics = [sub for sub in model.modules() if isinstance(sub, Metric)]
        for metric in self._metrics:
            metric.process_group = self.group
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, 0, group=self.group)

    def broadcast_sigterm(self, trainer: Any, rank: int) -> None:
        """Lightning's per-step SIGTERM flag from worker 0, among the workers only."""
        flag = torch.tensor([int(bool(getattr(trainer, "received_sigterm", False)))])
        try:
            dist.broadcast(flag, self._source(0), group=self.group)
        except RuntimeError as err:
            raise CommError(explain(
                f"worker {rank}: the workers' per-step broadcast (from worker 0) "
                f"failed: a worker hangs or died ({err})"
            )) from err  # fmt: skip
        if flag.item() == 1:
            dist.barrier(group=self.group)
            raise SIGTERMException()
