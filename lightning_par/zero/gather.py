"""ZeRO stage 3 (P_os+g+p): parameters sharded at rest, each unit all-gathered just before
the layer that uses it runs, forward and backward, freed after, the next one prefetched.

Rajbhandari et al. (2020, section 5.3) broadcast each layer's parameters from its owner as
the forward reaches it; PyTorch FSDP (Zhao et al., VLDB 2023, section 3.3) all-gathers a
unit before its forward and again before its backward and frees it after each, prefetching
the next unit in the order recorded on the first iteration. So does :class:`StageThree`:

* the **first step** runs with every unit gathered and records which modules' forwards run,
  in which order (a module's parameters may be used by its parent's forward without its own
  running: ``nn.MultiheadAttention`` calls ``F.linear`` on its ``out_proj``);
* from then on each unit is gathered at the forward pre-hook of the deepest module that ran
  and holds it (its *trigger*), freed at the trigger's forward post-hook, gathered again
  when the gradient of the trigger's output arrives, and freed once its own gradients are
  packed for their reduce-scatter;
* units no module's forward covers (the LightningModule's own parameters, used in
  ``training_step``) are gathered for the whole step.

The gathers run on the communication thread the gradients' reduce-scatters use, so every
rank runs one sequence of collectives. That sequence is the same on every rank as long as
every rank's backward produces the same units' gradients (a branch some ranks skip and
others take, data-dependently, is not supported).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Executor, Future
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from lightning_par.collectives import ring_all_gather
from lightning_par.comm import CommTrace, Communicator
from lightning_par.zero.units import FlatUnit


class StageThree:
    """Gather and free the units of ``root``'s parameters around the modules that use them
    (``trace``: where a ``wait for gather`` span records each time a layer waited for one)."""

    def __init__(
        self,
        root: nn.Module,
        units: list[FlatUnit],
        comm: Communicator,
        executor: Executor,
        trace: CommTrace | None = None,
    ) -> None:
        self.root, self.units, self.comm, self.executor = root, units, comm, executor
        self.trace = trace
        self._unit_of = {id(p): u for u in units for p in u.params}
        self._pending: dict[int, Future] = {}
        self._in_use = {u.index: 0 for u in units}
        self._order: list[FlatUnit] = []  # forward order, from the first step
        self._triggers: dict[nn.Module, list[FlatUnit]] = {}
        self.resident: list[FlatUnit] = []
        self._hooks: list = []
        self._called: list[nn.Module] = []
        self.probed = False
        for unit in units:
            unit.shard_at_rest()

    # ---- gathering -------------------------------------------------------------------------
    def prefetch(self, unit: FlatUnit) -> None:
        """Start gathering ``unit`` on the communication thread (no-op if it is there)."""
        if unit.gathered or unit.index in self._pending:
            return
        full = unit.allocate()
        event = None
        if full.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self._pending[unit.index] = self.executor.submit(self._gather, full, event)

    def _gather(self, full: torch.Tensor, ready_event) -> None:
        if ready_event is not None:
            torch.cuda.current_stream(full.device).wait_event(ready_event)
        ring_all_gather(full, comm=self.comm)

    def gather(self, unit: FlatUnit) -> None:
        """``unit``'s whole weights, now."""
        self.prefetch(unit)
        pending = self._pending.pop(unit.index, None)
        if pending is not None:
            with self.trace.span("wait for gather") if self.trace is not None else nullcontext():
                pending.result()

    def free(self, unit: FlatUnit) -> None:
        if unit.index in self._pending:
            self._pending.pop(unit.index).result()  # never free under a running gather
        unit.free()

    def gather_all(self) -> None:
        for unit in self.units:
            self.prefetch(unit)
        for unit in self.units:
            self.gather(unit)

    def free_all(self, keep_resident: bool = False) -> None:
        for unit in self.units:
            if not (keep_resident and unit in self.resident):
                self.free(unit)

    # ---- a step ----------------------------------------------------------------------------
    @contextmanager
    def step(self, training: bool) -> Iterator[None]:
        """Around one step's forward (``training``: its backward follows, which frees the
        units; else every unit is freed at the end)."""
        if not self.probed:
            self._start_probe()
        for unit in self.resident:
            self.gather(unit)
        try:
            yield
        finally:
            if not self.probed:
                self._finish_probe()
            if not training:
                self.free_all()

    def after_backward(self) -> None:
        """Free whatever backward left gathered (units without trainable parameters)."""
        self.free_all()

    def packed(self, unit: FlatUnit) -> None:
        """``unit``'s gradients are packed: backward no longer needs its weights."""
        if self.probed:
            self.free(unit)

    # ---- the first step: which module's forward uses which unit ------------------------------
    def _start_probe(self) -> None:
        self.gather_all()
        for module in self.root.modules():
            self._hooks.append(module.register_forward_pre_hook(self._record))

    def _record(self, module: nn.Module, args) -> None:
        self._called.append(module)

    def _finish_probe(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        called = set(self._called)
        parent = {child: m for m in self.root.modules() for child in m.children()}
        first_call = {}
        for n, m in enumerate(self._called):
            first_call.setdefault(m, n)
        triggers: dict[nn.Module, list[FlatUnit]] = {}
        resident: list[FlatUnit] = []
        for module in self.root.modules():
            held = {
                self._unit_of[id(p)].index: self._unit_of[id(p)]
                for p in module._parameters.values()
                if p is not None and id(p) in self._unit_of
            }
            trigger = module
            while trigger is not None and trigger not in called:
                trigger = parent.get(trigger)
            for unit in held.values():
                if trigger is None or trigger is self.root:
                    resident.append(unit)
                elif unit not in triggers.setdefault(trigger, []):
                    triggers[trigger].append(unit)
        self.resident = list({u.index: u for u in resident}.values())
        self._triggers = {
            m: [u for u in us if u not in self.resident] for m, us in triggers.items()
        }
        by_first_call = sorted(self._triggers, key=lambda m: first_call[m])
        self._order = list({u.index: u for m in by_first_call for u in self._triggers[m]}.values())
        self._position = {u.index: n for n, u in enumerate(self._order)}
        for module in by_first_call:
            if self._triggers[module]:
                self._hooks.append(module.register_forward_pre_hook(self._before_forward))
                self._hooks.append(module.register_forward_hook(self._after_forward))
        self._called = []
        self.probed = True

    # ---- hooks -----------------------------------------------------------------------------
    def _neighbour(self, units: list[FlatUnit], direction: int) -> FlatUnit | None:
        positions = [self._position[u.index] for u in units]
        n = (max(positions) + 1) if direction > 0 else (min(positions) - 1)
        return self._order[n] if 0 <= n < len(self._order) else None

    def _before_forward(self, module: nn.Module, args) -> None:
        units = self._triggers[module]
        for unit in units:
            self._in_use[unit.index] += 1
            self.gather(unit)
        following = self._neighbour(units, +1)
        if following is not None:
            self.prefetch(following)

    def _after_forward(self, module: nn.Module, args, output) -> None:
        units = self._triggers[module]
        for unit in units:
            self._in_use[unit.index] -= 1
            if self._in_use[unit.index] == 0:
                self.free(unit)
        outputs = [t for t in _tensors(output) if t.requires_grad]
        if outputs:
            torch.autograd.graph.register_multi_grad_hook(
                outputs, lambda grads, units=units: self._before_backward(units), mode="any"
            )

    def _before_backward(self, units: list[FlatUnit]) -> None:
        for unit in units:
            self.gather(unit)
        previous = self._neighbour(units, -1)
        if previous is not None:
            self.prefetch(previous)

    def close(self) -> None:
        """Remove the hooks and give every parameter its whole weights back."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.gather_all()
        for unit in self.units:
            unit.restore_whole()


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors(item)]
    return []
