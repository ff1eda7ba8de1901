"""ZeRO's gradient shards (P_g): each unit's gradients reduce-scattered as soon as backward
has produced them all, on a communication thread, while backward computes earlier layers.

As DDP's buckets (:mod:`lightning_par.comm.buckets`) but with a reduce-scatter
(:func:`~lightning_par.collectives.ring_reduce_scatter`) in place of the allreduce: each
rank keeps only the sum of its own shard, ``1/p`` of the gradient bytes, and the whole
gradients are dropped once packed (Rajbhandari et al., 2020, section 5.2). Units start in a
fixed order on every rank, whatever order autograd finishes them in, so every rank runs the
same sequence of collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from contextlib import contextmanager

import torch

from lightning_par.collectives import ring_reduce_scatter
from lightning_par.comm import CommTrace, Communicator, Event
from lightning_par.zero.units import FlatUnit

#: ``(unit, this rank's summed gradient shard, whether any rank had each parameter's)``
ShardDone = Callable[[FlatUnit, torch.Tensor, list[bool]], None]


class ShardedGradients:
    """Reduce-scatter the gradients of ``units`` (listed in the order backward finishes
    them) over ``comm``, averaged, handing each rank's shard to ``done`` after backward.

    Args:
        units: the units, in the order their reduce-scatters start.
        comm: the ranks.
        executor: the communication thread (shared with the parameter gathers of stage 3,
            so that every rank runs one sequence of collectives).
        done: called in :meth:`synchronize` for each unit.
        packed: called on the caller's thread right after a unit's gradients are packed
            (stage 3 frees the unit's gathered weights there: backward is done with them).
        trace: where to record one ``reduce-scatter <i>`` event per unit.
    """

    def __init__(
        self,
        units: list[FlatUnit],
        comm: Communicator,
        executor: Executor | None,
        done: ShardDone,
        packed: Callable[[FlatUnit], None] = lambda unit: None,
        trace: CommTrace | None = None,
    ) -> None:
        self.units, self.comm, self.executor = units, comm, executor
        self.done, self.packed, self.trace = done, packed, trace
        self.enabled = True
        self._next = 0
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._flags = {u.index: len(u.params) for u in units}
        self._futures: dict[int, Future | None] = {}
        self._ready: dict[int, set[int]] = {u.index: set() for u in units}
        self._trainable = {u.index: [p for p in u.params if p.requires_grad] for u in units}
        self._unit_of = {id(p): u for u in units for p in u.params}
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._grad_ready)
            for u in units
            for p in self._trainable[u.index]
        ]

    def known(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s gradient has a shard: it was trainable when the hooks went on
        (one frozen then, unfrozen later, is in a unit but has no hook)."""
        unit = self._unit_of.get(id(param))
        return unit is not None and any(param is q for q in self._trainable[unit.index])

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: keep the whole local gradients, no communication."""
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous

    def _grad_ready(self, param: torch.Tensor) -> None:
        if not self.enabled:
            return
        unit = self._unit_of[id(param)]
        self._ready[unit.index].add(id(param))
        self._start_ready()

    def _start_ready(self, force: bool = False) -> None:
        while self._next < len(self.units):
            unit = self.units[self._next]
            trainable = self._trainable[unit.index]
            if not force and len(self._ready[unit.index]) < len(trainable):
                return
            self._next += 1
            if trainable:
                self._start(unit)

    def _start(self, unit: FlatUnit) -> None:
        rows = unit.pack_gradients(1.0 / self.comm.world_size)
        for p in unit.params:
            p.grad = None  # the shard is all this rank keeps
        self.packed(unit)
        self._futures[unit.index] = None
        if self.executor is None:
            self._run(unit.index, rows, None)
            return
        event = None
        if rows.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self._futures[unit.index] = self.executor.submit(self._run, unit.index, rows, event)

    def _run(self, index: int, rows: torch.Tensor, ready_event) -> None:
        if ready_event is not None:
            torch.cuda.current_stream(rows.device).wait_event(ready_event)
        start = self.trace.now() if self.trace is not None else 0.0
        ring_reduce_scatter(rows, comm=self.comm)
        # keep this rank's row only (the other rows are the whole gradients' size): its
        # gradients and its flags apart, so that the shard holds S elements, no more
        s = rows.shape[1] - self._flags[index]
        mine = rows[self.comm.rank]
        self._rows[index] = (mine[:s].clone(), mine[s:].clone())
        if self.trace is not None:
            self.trace.events.append(
                Event(self.comm.global_rank, f"reduce-scatter {index}", start, self.trace.now())
            )

    def synchronize(self) -> None:
        """After backward: start the units still waiting (parameters unused this step count
        as zero gradients), wait for every reduce-scatter and hand each shard to ``done``."""
        self._start_ready(force=True)
        try:
            for unit in self.units:
                if unit.index not in self._futures:
                    continue
                future = self._futures[unit.index]
                if future is not None:
                    future.result()  # re-raises a failed collective here
                grads, flags = self._rows[unit.index]
                self.done(unit, grads, [count > 0 for count in flags.tolist()])
        finally:
            self._rows.clear()
            self._futures.clear()
            for ready in self._ready.values():
                ready.clear()
            self._next = 0

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
