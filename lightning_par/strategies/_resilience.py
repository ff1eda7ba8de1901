"""``fault_tolerant=True`` in a data-parallel strategy: the hooks' share of it.

A strategy holds one :class:`Resilience` and calls it from its hooks unconditionally (off,
each call does nothing): the checks before launch, the start of the membership after the
process group, the step settled after the gradient exchange, Lightning's optimiser closure
retried after a loss, and the lost ranks' batches trained beside this rank's own
(:mod:`._stand_ins`). The algorithm is :mod:`lightning_par.components.fault_tolerance`.

What it cannot keep exact is refused, naming the fix: gradient accumulation (a step lost
half-way would have summed some micro-batches already), manual optimisation (the step is
the user's), and rank 0's own loss where no survivor can take its place (it holds the
loggers and checkpoints, and under ``popen`` it is the user's script: that run ends with
the line naming it). Under a fork launch, torchrun and srun, where the job's store outlives
rank 0, the first survivor takes over rank 0's share (:mod:`._leader`).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn

from lightning_par import _compat
from lightning_par.components import rejoin
from lightning_par.components.fault_tolerance import FaultTolerance
from lightning_par.components.process_group import destroy_process_group
from lightning_par.launch.joining import JOIN_ENV, Admission, NotAdmitted, withdraw
from lightning_par.launch.rendezvous import dead_peer_timeout
from lightning_par.strategies import _joiner
from lightning_par.strategies._leader import lead_again, share_versions, take_over
from lightning_par.strategies._stand_ins import LostShards, stand_in_outputs, with_stand_ins


class Resilience:
    """The fault-tolerance hooks of ``strategy`` (a ``ParStrategy``); ``enabled``: the
    strategy's ``fault_tolerant`` option; ``recovery``: what the survivors do after a loss,
    in words (:class:`FaultTolerance`'s line)."""

    def __init__(self, strategy: Any, enabled: bool, recovery: str | None = None) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"fault_tolerant must be True or False, got {enabled!r}")
        self._strategy, self.enabled = strategy, enabled
        self.tolerance = FaultTolerance() if recovery is None else FaultTolerance(recovery)
        self._shards = LostShards()
        #: in a replacement that joins a running fit: its admission, until its first step
        self.admission: Admission | None = None

    @property
    def members(self) -> list[int] | None:
        """The ranks still in the job, by their first numbers (None: off)."""
        membership = self.tolerance.membership
        return None if membership is None else list(membership.members)

    def _refuse(self, what: str, fix: str) -> None:
        name = self._strategy.strategy_name
        raise ValueError(f"{name}(fault_tolerant=True) cannot {what}: {fix}")

    def check_before_launch(self, trainer: Any) -> None:
        """Refuse what a lost rank would leave inexact, before any rank starts (again in
        each rank: torchrun and SLURM start the ranks without a launch of ours)."""
        if not self.enabled:
            return
        if trainer is not None and trainer.reload_dataloaders_every_n_epochs:
            self._refuse(
                "reload the data loaders every epoch (reload_dataloaders_every_n_epochs="
                f"{trainer.reload_dataloaders_every_n_epochs}): the survivors read the lost "
                "ranks' shards of the loader the fit began with",
                "set reload_dataloaders_every_n_epochs=0, or fault_tolerant=False",
            )
        if trainer is not None and trainer.accumulate_grad_batches != 1:
            self._refuse(
                f"accumulate gradients (accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches}): a step lost half-way has summed some "
                "micro-batches already",
                "use a larger batch_size instead, or fault_tolerant=False",
            )
        model = self._strategy.launch_arguments.get("model")
        if model is not None and not getattr(model, "automatic_optimization", True):
            self._refuse(
                "run manual optimisation: the step it would run again is your code's",
                "use automatic optimisation, or fault_tolerant=False",
            )

    def leave_an_earlier_group(self) -> None:
        """Before this strategy's group, in a script that built a new Trainer (a new
        strategy) after an earlier call: the ranks are still in that call's group, whose
        store counted its steps, where this fit's would meet them again. They end it and
        meet in a new group (every rank runs the same script: all do); one that joined as
        a replacement is a member like the others now."""
        if not self.enabled or self.tolerance.membership is not None:
            return
        if dist.is_initialized():
            self._strategy.set_world_ranks()
            if dist.get_world_size() == self._strategy.world_size:  # (else refused next)
                destroy_process_group()
                os.environ.pop(JOIN_ENV, None)

    def start(self) -> None:
        """After the process group: every rank joins the membership."""
        if not self.enabled:
            return
        strategy = self._strategy
        if self.tolerance.membership is not None:  # fit, then validate: the same members
            lead_again(self.tolerance.membership.rank)
            return
        # a member slow to answer is waited for as long as a collective would wait for it
        # (a frozen one is found by the heartbeat after dead_peer_timeout, and ended)
        limit = strategy.timeout.total_seconds()
        silent = dead_peer_timeout(strategy.timeout, strategy.dead_peer_timeout)
        self.tolerance.start(
            strategy.process_group_store, strategy.global_rank, strategy.world_size,
            strategy._get_process_group_backend(), strategy.timeout, limit, silent,
            strategy.root_device,
        )  # fmt: skip

    def setup(self, trainer: Any) -> None:
        """After the strategy's setup: a ``fit`` shards its data over the members now."""
        if self.enabled and trainer.state.fn == TrainerFn.FITTING:
            self.check_before_launch(trainer)
            if self.admission is not None:  # a joiner: it has the leader's (and no peers yet)
                return
            share_versions(trainer)  # (a survivor may take over rank 0's loggers)
            self.tolerance.begin_fit()
            self.tolerance.watching = True

    def train_ended(self) -> None:
        """The ``fit`` ended (every member ends it at the same step): no replacement joins
        until the next one."""
        if self.enabled:
            self.tolerance.end_fit()

    def teardown(self) -> None:
        """The end of a trainer call: nothing to watch until the next ``fit``."""
        self.tolerance.watching = False

    # ---- a replacement joining the running fit (:mod:`._joiner`) --------------------------
    def joins_running_job(self) -> bool:
        """Whether this process is a lost rank's replacement (started with
        ``LIGHTNING_PAR_JOIN``, by its keeper) that has not joined yet."""
        return self.enabled and bool(os.environ.get(JOIN_ENV)) and self.tolerance.membership is None

    def join_running_job(self) -> None:
        """Instead of meeting the first ranks: ask to join the running ``fit`` and receive
        its training state, which Lightning then restores (see :mod:`._joiner`). Turned
        away, the replacement says why and its script ends (exit code 0)."""
        strategy = self._strategy
        strategy.set_world_ranks()
        backend = strategy._get_process_group_backend()
        _compat.set_process_group_backend(strategy, backend)
        store, _ = strategy.group_store()
        strategy.process_group_store = store
        silent = dead_peer_timeout(strategy.timeout, strategy.dead_peer_timeout)
        limit = strategy.timeout.total_seconds()
        try:
            self.admission, state = rejoin.join(
                self.tolerance, store, strategy.global_rank, backend, strategy.timeout,
                limit, silent, strategy.root_device,
            )  # fmt: skip
            trainer = strategy.lightning_module.trainer
            _joiner.take_extras(trainer, self.admission.extras)  # (before callbacks resolve)
            try:
                _joiner.restore_in_joiner(trainer, state)
            except Exception as err:  # (weights_only refuses a type: say which, and go)
                why = f"its training state could not be read ({str(err).splitlines()[0]})"
                withdraw(store, self.tolerance.membership.me, why)
                raise NotAdmitted(why) from err
        except NotAdmitted as why:
            self._turned_away(why)
        strategy.take_extras(self.admission.extras)

    def _turned_away(self, why: BaseException) -> None:
        name = self._strategy.rank_name(self._strategy.global_rank)
        print(f"lightning_par: the replacement of {name} did not join the running fit: "
              f"{why}; it ends", file=sys.stderr, flush=True)  # fmt: skip
        raise SystemExit(0)

    def process_dataloader(self, loader: Any) -> Any:
        """A joiner's training loader reads on from the members' batch."""
        admission = self.admission
        if admission is not None and self._strategy.lightning_module.trainer.training:
            try:
                _joiner.resume_at(loader, admission.epoch, admission.batch)
            except ValueError as err:
                assert self.tolerance.membership is not None
                withdraw(self.tolerance.membership.store, self.tolerance.membership.me, str(err))
                self._turned_away(err)
        return loader

    def at_step_start(self, regrouped: Any) -> None:
        """As a training step begins: the members admit the replacements that asked (the
        leader sends them the state); a replacement meets the members. ``regrouped()``
        rebuilds what held the old group."""
        if not self.enabled:
            return
        trainer = self._strategy.lightning_module.trainer
        if self.admission is not None:
            try:
                rejoin.enter(self.tolerance, self.admission, self._strategy.rank_name)
            except (NotAdmitted, RuntimeError) as why:
                self._turned_away(why)
            _compat.batches_that_stepped(trainer, self.admission.extras["stepped"])
            self.admission = None
            regrouped()
            return
        if rejoin.admit(self.tolerance, lambda: self._offer(trainer), trainer.global_step):
            regrouped()

    def _offer(self, trainer: Any) -> rejoin.Offer:
        extras = {**_joiner.extras_for_joiner(trainer), **self._strategy.extras_for_joiners()}
        epoch, batch = trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx
        return rejoin.Offer(_joiner.state_for_joiner(trainer), epoch, batch, extras)

    def sampler_kwargs(self, first: dict[str, Any]) -> dict[str, Any]:
        """A loader built after a loss shards over the survivors (``first``: Lightning's)."""
        if not self.enabled:
            return first
        trainer = self._strategy.lightning_module.trainer
        return self.tolerance.sampler_kwargs(first, training=bool(trainer and trainer.training))

    def leads(self) -> bool:
        """Whether this rank does rank 0's share for Lightning (loggers, checkpoints,
        ``rank_zero_only``): rank 0, or, once rank 0 was lost, the first survivor."""
        membership = self.tolerance.membership
        if membership is None:
            return self._strategy.global_rank == 0
        return membership.rank == 0

    def regrouped(self, trainer: Any) -> None:
        """After a loss: the next validation reads its data over the survivors, and the
        first survivor takes over rank 0's share if rank 0 was lost."""
        _compat.reset_combined_loader(trainer.fit_loop.epoch_loop.val_loop)
        if self.tolerance.membership is not None:
            take_over(trainer, self.tolerance.membership.rank)

    def settle(self) -> None:
        """After the gradient exchange: step only if every member's succeeded."""
        if self.enabled:
            self.tolerance.settle(self._strategy.lightning_module.trainer.global_step)

    def retrying(self, closure: Any, regrouped: Any, module: Any = None) -> Any:
        """Lightning's closure, run again after a loss (``regrouped()`` rebuilds); the
        buffers of ``module`` (BatchNorm's running statistics) are put back as the step
        found them before it runs again, so its batch updates them once."""
        if not self.enabled:
            return closure
        if module is None:
            return self.tolerance.retrying(closure, regrouped)
        with torch.no_grad():
            kept = [(b, b.clone()) for b in module.buffers()]

        def again() -> None:
            with torch.no_grad():
                for buffer, value in kept:
                    buffer.copy_(value)
            regrouped()

        return self.tolerance.retrying(closure, again)

    def with_lost_shards(
        self, output: Any, step: Any, batch: Any, batch_idx: int = 0, *rest: Any
    ) -> Any:
        """``output`` of this rank's ``step`` (the strategy's ``training_step`` below the
        one calling this), its gradient also that of the lost shards this rank stands in
        for (see :mod:`._stand_ins`)."""
        if not self.enabled or not self.tolerance.lost:
            return output
        strategy = self._strategy
        trainer = strategy.lightning_module.trainer
        ranks = self.tolerance.stands_in_for()
        batches = self._shards.batches(trainer.train_dataloader, ranks, batch_idx)
        batches = [strategy.batch_to_device(b) for b in batches]

        def own_step(b: Any, i: int) -> Any:
            return step(b, i, *rest)

        extra = stand_in_outputs(own_step, batches, batch_idx, strategy.lightning_module)
        return with_stand_ins(output, extra, self.tolerance.loss_scale)
