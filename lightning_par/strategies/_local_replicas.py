"""``local_sgd(fault_tolerant=True)``: the hooks' share of keeping every replica.

:class:`~lightning_par.strategies.local_sgd.LocalSGDStrategy` holds one
:class:`LocalReplicas` and calls it from its hooks (off, each call does nothing); the
algorithm is :mod:`lightning_par.components.replica_ring`:

* ``before_step`` (its ``training_step``): the step's record opens: its batch, the
  optimiser's hyperparameters, the random state. At a fit's first step the replicas are
  one process's (the weights broadcast, one optimiser state), so each rank takes its own
  state for its left neighbour's;
* ``after_step`` (after the optimiser step): the record closes and every replica this rank
  stands in for trains the step too (after a loss: every step since the averaging first);
* ``average`` (each averaging; :class:`~lightning_par.components.fault_tolerance.FaultTolerance`
  runs it again over the survivors after a loss): the lost replicas stood in for, the mean
  of every replica, each rank's replicas' states passed to its right neighbour, the
  outcome agreed on (``settle``), and only then the mean written;
* ``regrouped`` (after a loss found by an averaging, or by a reduce or barrier of
  Lightning's): which survivor trains each lost member's replica; it takes it over after
  its next step or at the averaging, whichever comes first.

A stand-in's step is the user's: ``training_step`` (logging nothing), ``backward`` with its
hooks, ``optimizer_zero_grad``, gradient clipping and ``on_before_optimizer_step`` through
the precision plugin, and the optimiser's ``step``, with the hyperparameters the lost
member's step had (an LR scheduler's too). Per-batch callback hooks
(``on_train_batch_end``) run for a rank's own replica only; randomness in the data
pipeline (augmentations) is drawn afresh for a lost shard, the training step's (dropout)
is the lost member's; a ``training_step`` making collectives of its own (``all_gather``)
cannot be stood in for. What cannot be exact is refused: ``16-mixed`` (one GradScaler per
process, whose scale a stand-in's steps would move), and what
:class:`~lightning_par.strategies._resilience.Resilience` refuses.
"""

from __future__ import annotations

import copy
import sys
import time
from typing import Any

import torch

from lightning_par.collectives.averaging import averaged_tensors, replica_mean
from lightning_par.components.replica_ring import (
    ReplicaLayout,
    ReplicaState,
    StandIn,
    StepRecord,
    decode_states,
    encode_states,
    hyperparameters,
    kept_random_state,
    next_hosts,
    pass_right,
    random_state,
    same_random_state,
)
from lightning_par.strategies._base import ParStrategy
from lightning_par.strategies._resilience import Resilience
from lightning_par.strategies._stand_ins import (
    LostShards,
    check_loader,
    current_epoch,
    loss_of,
    muted_logging,
)


class LocalReplicas:
    """The replicas of ``strategy`` (a ``LocalSGDStrategy``) kept past lost members (module
    docstring); ``allreduce`` sums them, ``buffers``: floating buffers are averaged too."""

    def __init__(self, strategy: Any, resilience: Resilience, allreduce: Any, buffers: bool):
        self._strategy, self.enabled = strategy, resilience.enabled
        self.tolerance = resilience.tolerance
        self._allreduce, self._buffers = allreduce, buffers
        self._shards = LostShards()
        #: averagings agreed on by this strategy's members (each agreement's key)
        self.settled = 0
        self.begin_fit()

    def check_before_launch(self) -> None:
        """Refuse what a stand-in cannot train exactly."""
        if self.enabled and getattr(self._strategy.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                "local_sgd(fault_tolerant=True) cannot train a lost rank's replica under "
                "precision='16-mixed': each process has one GradScaler, whose loss scale the "
                "stand-in's steps would move. Use precision='bf16-mixed' or '32-true', or "
                "fault_tolerant=False"
            )

    def begin_fit(self) -> None:
        """A ``fit`` begins: nothing is replicated yet (the first step does it)."""
        self.layout: ReplicaLayout | None = None
        self.base: list[torch.Tensor] = []  # the averaged tensors of the last averaging
        self.held: dict[int, ReplicaState] = {}  # the left neighbour's replicas then
        self.ring: list[int] = []  # the members then, and the replicas each trained
        self.hosted: dict[int, list[int]] = {}
        self.hosts: dict[int, list[int]] = {}  # who trains which replica now
        self.stand_ins: dict[int, StandIn] = {}
        self.records: list[StepRecord] = []  # the steps since the last averaging
        self._open: StepRecord | None = None

    # ---- each step ---------------------------------------------------------------------------
    def before_step(self, batch_idx: int) -> None:
        """This rank's step begins: open its record (once: an optimiser may run its closure
        again)."""
        strategy = self._strategy
        if not self.enabled or self._open is not None or strategy.world_size == 1:
            return  # (one replica: no averaging, nothing to keep)
        loader = strategy.lightning_module.trainer.train_dataloader
        if self.layout is None:
            check_loader(loader)  # (a lost shard must be readable: refused at the first step)
            self._replicate_first()
        self._open = StepRecord(
            current_epoch(loader), batch_idx,
            hyperparameters(strategy.optimizers[0]), random_state(strategy.root_device),
        )  # fmt: skip

    def _replicate_first(self) -> None:
        strategy = self._strategy
        module = strategy.lightning_module
        self.layout = layout = ReplicaLayout(module, averaged_tensors(module, self._buffers))
        self.base = [t.detach().clone() for t in layout.pick(layout.tensors, layout.averaged)]
        assert self.tolerance.membership is not None
        members, me = list(self.tolerance.membership.members), self.tolerance.membership.me
        self.ring, self.hosted = members, {m: [m] for m in members}
        self.hosts = copy.deepcopy(self.hosted)
        left = members[(members.index(me) - 1) % len(members)]
        kept = [t.detach().clone() for t in layout.pick(layout.tensors, layout.kept)]
        own = copy.deepcopy(strategy.optimizers[0].state_dict())
        self.held = {left: ReplicaState(own, kept, None)}

    def after_step(self) -> None:
        """This rank's optimiser stepped: every replica it stands in for steps too."""
        if not self.enabled or self._open is None:
            return
        self.records.append(self._open)
        self._open = None
        self._stand_in()

    # ---- standing in -------------------------------------------------------------------------
    def regrouped(self) -> None:
        """The survivors met: who trains each lost member's replica (its right neighbour at
        the last averaging, which holds its state)."""
        if self.layout is not None:
            assert self.tolerance.membership is not None
            self.hosts = next_hosts(self.hosted, self.ring, self.tolerance.membership.members)

    def _stand_in(self) -> None:
        """Take over the replicas this rank now hosts; each catches up with this rank."""
        assert self.tolerance.membership is not None and self.layout is not None
        me = self.tolerance.membership.me
        for member in self.hosts.get(me, [me]):
            if member != me and member not in self.stand_ins:
                started = time.monotonic()
                self.stand_ins[member] = StandIn.build(
                    member, self.layout, self.base, self.held[member], self._strategy.optimizers[0]
                )
                self._catch_up(self.stand_ins[member])
                print(
                    f"lightning_par: local_sgd: rank {me} trains rank {member}'s replica too, "
                    f"rebuilt as of the last averaging ({len(self.records)} step(s) since "
                    f"replayed in {time.monotonic() - started:.2f} s)",
                    file=sys.stderr, flush=True,
                )  # fmt: skip
        for stand_in in self.stand_ins.values():
            self._catch_up(stand_in)

    def _catch_up(self, stand_in: StandIn) -> None:
        for record in self.records[stand_in.trained :]:
            self._train(stand_in, record)
            stand_in.trained += 1

    def _train(self, stand_in: StandIn, record: StepRecord) -> None:
        """One step of ``stand_in``, as its member would have run it (module docstring)."""
        strategy = self._strategy
        module = strategy.lightning_module
        device = strategy.root_device
        assert self.layout is not None
        shard = self.tolerance.fit_members.index(stand_in.member)
        with kept_random_state(device):  # reading a batch again moves no random stream
            loader = module.trainer.train_dataloader
            batch = self._shards.batches(loader, [shard], record.batch_idx, record.epoch)[0]
        batch = strategy.batch_to_device(batch)
        optimizer = stand_in.optimizer
        for group, values in zip(optimizer.param_groups, record.hyperparameters):
            group.update(copy.deepcopy(values))

        def closure() -> torch.Tensor | None:  # (Lightning's: a step returning None skips)
            output = ParStrategy.training_step(strategy, batch, record.batch_idx)
            loss = None if output is None else loss_of(output, "a lost rank's batch")
            module.optimizer_zero_grad(record.epoch, record.batch_idx, optimizer)
            if loss is not None:
                strategy.backward(loss, optimizer)
            return loss

        with stand_in.installed(self.layout.tensors, record.random, device):
            with muted_logging(module), torch.enable_grad():
                ParStrategy.optimizer_step(strategy, optimizer, closure, module)

    # ---- averaging ---------------------------------------------------------------------------
    def average(self) -> None:
        """One averaging of every replica of the first world, over the members there are
        now (run again by the caller when one is lost meanwhile)."""
        strategy = self._strategy
        assert self.layout is not None and self.tolerance.membership is not None
        self._stand_in()
        layout, me = self.layout, self.tolerance.membership.me
        stand_ins = [self.stand_ins[m] for m in sorted(self.stand_ins)]
        replicas = [layout.pick(layout.tensors, layout.averaged)]
        replicas += [layout.pick(s.tensors, layout.averaged) for s in stand_ins]
        total = len(self.tolerance.fit_members)
        means = replica_mean(replicas, total, self._allreduce, strategy.comm)
        now = random_state(strategy.root_device)
        own = ReplicaState(
            strategy.optimizers[0].state_dict(), layout.pick(layout.tensors, layout.kept), now
        )
        mine = {me: own, **{s.member: s.state(layout, now) for s in stand_ins}}
        payload = encode_states(mine).to(strategy.root_device)
        received = decode_states(pass_right(strategy.comm, payload))
        self.tolerance.settle(self.settled)  # every member got this far, or StepLost
        with torch.no_grad():
            for replica in replicas:
                for t, mean in zip(replica, means):
                    t.copy_(mean)
        self.base = means
        for state in received.values():  # a stream equal to this rank's follows it
            if state.random is not None and same_random_state(state.random, now):
                state.random = None
        self.held = received
        self.ring, self.hosted = list(self.tolerance.membership.members), copy.deepcopy(self.hosts)
        self.records.clear()
        for stand_in in stand_ins:
            stand_in.trained = 0
        self.settled += 1
