"""Launchers for every lightning_par strategy: the launch policy applied at ``fit`` time.

:class:`PolicyLauncher` decides how to start the ranks when ``Trainer.fit/test/...`` runs
(not when the Trainer is built: CUDA may be initialised in between), following
:func:`lightning_par.comm.plan_launch`, and then

* runs the strategy's ``check_before_launch(trainer)`` in the main process, so a bad
  configuration fails once, with its own message, before any process starts;
* warns when more ranks than cores (or GPUs) are asked for;
* ``popen`` with ``fault_tolerant``: this process keeps rank 0, one more run of the script
  (:func:`~._lost_peers.keep_popen_rank_0`), and never returns;
* on one machine, binds the job's rendezvous store on a port the OS gives it before any
  rank starts (:func:`~lightning_par.launch.rendezvous.host_job_store`), so two jobs started
  at once never meet in one store;
* forked ranks compute on the threads the plan allows and lead their own process group;
* forkserver ranks start from the main process's state at the launch, as forked ones would:
  its environment, random states, deterministic flags and standard output
  (:class:`~lightning_par.launch.parent_state.ParentState`);
* an interrupt of the main process (Ctrl-C, Jupyter's "interrupt kernel", SIGTERM from a
  scheduler) or any error there stops every rank and what it started, and says where the
  newest checkpoint is (:mod:`._interrupts`);
* a rank lost (killed, ended without raising, or silent for ``dead_peer_timeout``) ends the
  job at once with :class:`~lightning_par.launch.lost.RankLost`, one line naming the rank,
  how it was lost and the newest checkpoint (:mod:`._lost_ranks`; a ``popen`` launch's
  scripts: :mod:`._script_ranks`), which a script that does not catch it prints alone;
* a rank's exception reaches the main process with its own type (``ValueError``, ...),
  chained to torch's report of the rank's traceback (:mod:`._rank_errors`);
* after a fork ``fit`` the main process gets the FULL model and the training state
  (optimiser and scheduler states, loops: :mod:`._carry_back`), gathered from every stage by
  model-split strategies, so the script's ``save_checkpoint`` writes what one process would;
  after every launch, rank 0's random states and trace (as files, not through the queue).

:class:`ExistingRanksLauncher` is used when the ranks already exist (torchrun, SLURM,
``run_on_ranks``, ``popen``'s scripts): it starts nothing, also in a notebook, and the
ranks name a lost peer themselves (:mod:`._lost_peers`).
"""

from __future__ import annotations

import inspect
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_par import _compat
from lightning_par.launch.lost import (
    REPORTS_ENV,
    RankLost,
    new_folder_name,
    one_line_when_uncaught,
    reports_to,
)
from lightning_par.launch.parent_state import ParentState
from lightning_par.launch.policy import (
    FORKSERVER_PRELOAD,
    LaunchPlan,
    limit_threads_after_fork,
    plan_launch,
    process_state,
    warn_if_oversubscribed,
)
from lightning_par.launch.processes import die_with_parent, forkserver_context
from lightning_par.launch.rendezvous import STORE_ENV, host_job_store
from lightning_par.strategies._carry_back import output_for_script, recover_in_script
from lightning_par.strategies._interrupts import lost_rank_message, sigterm_as_interrupt, stop_ranks
from lightning_par.strategies._lost_peers import LostPeers, keep_from_launcher, keep_popen_rank_0
from lightning_par.strategies._lost_ranks import joined_by_us
from lightning_par.strategies._rank_errors import RankErrors
from lightning_par.strategies._script_ranks import ScriptRanks


def launch_arguments(function: Callable, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of the ``Trainer`` method a launcher is asked to run (``ckpt_path``,
    ``model``, ...), by name: Lightning keeps the path in no attribute until the ranks run,
    and the strategy checks it before any rank starts."""
    return dict(inspect.signature(function).bind_partial(*args, **kwargs).arguments)


class ExistingRanksLauncher(_compat.SubprocessScriptLauncher):
    """Every rank already runs this code: start nothing (as safe in a notebook as anywhere);
    a lost peer is named in one line by the ranks themselves (:mod:`._lost_peers`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lost_peers = LostPeers()

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return True

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kw):
        if trainer is not None:
            trainer.strategy.launch_arguments = launch_arguments(function, args, kw)
            keep_from_launcher(trainer.strategy)  # (a survivable rank, torchrun or srun)
        with self.lost_peers.watching(trainer):
            return function(*args, **kw)


class PolicyLauncher(_compat.MultiProcessingLauncher):
    """Starts the ranks as the launch policy says (see the module docstring)."""

    def __init__(self, strategy: Any, requested: str | None = None) -> None:
        super().__init__(strategy, start_method="fork")
        self.requested = requested
        self.plan: LaunchPlan | None = None
        self._script: _compat.SubprocessScriptLauncher | None = None
        self._scripts: ScriptRanks | None = None  # popen: the ranks started as scripts
        self._rank_errors: RankErrors | None = None
        self._queue: Any = None  # a rank's queue to the main process (set in the rank)
        self._parent = ParentState()  # pickled with this launcher for each forkserver rank

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return True  # the plan forks in a notebook, or stops with a LaunchError saying why

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kw):
        strategy = self._strategy
        strategy.launch_arguments = launch_arguments(function, args, kw)
        strategy.check_before_launch(trainer)
        devices = strategy.parallel_devices  # the kind of device the ranks will run on
        device = devices[0].type if devices else "cpu"
        # Lightning creates these ranks (its environment said so), whatever SLURM_* or
        # torchrun variables an interactive allocation leaves in the environment
        state = replace(process_state(), external_ranks=False)
        self.plan = plan_launch(
            device, strategy.num_processes, requested=self.requested, state=state
        )
        strategy.launch_plan = self.plan
        keep_popen_rank_0(strategy, self.plan.method)  # (popen, fault_tolerant: never returns)
        if strategy.num_nodes == 1:  # a store bound now: no other job can take its port
            if self.plan.method != "popen":
                strategy.store_spec = host_job_store()  # new ranks each launch
            else:  # the scripts re-run once, for the first launch; this process is rank 0
                if STORE_ENV not in os.environ:  # (held for the scripts' whole life)
                    os.environ[STORE_ENV] = host_job_store()
                strategy.store_spec = os.environ[STORE_ENV]
        devices = None if device == "cpu" else _device_count(device)
        warn_if_oversubscribed(device, strategy.num_processes, devices)
        self._trainer, self._started = trainer, time.time()
        # the ranks leave here their exceptions (fork: raised again below with their own
        # type) and their reports of a lost peer (:mod:`._lost_ranks`); popen: one folder for
        # the scripts' whole life (they read its name once, as they start)
        popen = self.plan.method == "popen"
        folder = (
            os.environ.setdefault(REPORTS_ENV, new_folder_name()) if popen else new_folder_name()
        )
        errors = self._rank_errors = RankErrors(folder) if not popen else None
        try:
            with sigterm_as_interrupt(), reports_to(folder):
                if popen:
                    return self._launch_scripts(function, args, trainer, kw)
                self._start_method = self.plan.method
                if self.plan.method == "forkserver":
                    forkserver_context(FORKSERVER_PRELOAD)
                # async_sgd goes on without a lost worker
                survive = getattr(strategy, "survives_lost_workers", False)
                zero = getattr(strategy, "survives_lost_rank_zero", False)
                with joined_by_us(folder, strategy.rank_name, survive, zero):
                    return super().launch(function, *args, trainer=trainer, **kw)
        except BaseException as error:
            procs = self._script.procs if self._script is not None else self.procs
            lost = error if isinstance(error, RankLost) else None
            if lost is None and self._scripts is not None:  # popen: a script lost?
                lost = self._scripts.cause_of(error)
            stop_ranks(procs, trainer, error, self._started)
            if lost is not None:
                message = lost_rank_message(lost, trainer, self._started)
                one_line_when_uncaught()
                raise RankLost(message, lost.rank, lost.details) from None
            original = errors.original(error) if errors is not None else None
            if original is not None:
                raise original from error
            raise
        finally:
            self._rank_errors = None
            shutil.rmtree(folder, ignore_errors=True)

    def _launch_scripts(self, function: Callable, args: tuple, trainer: Any, kw: dict) -> Any:
        """popen: this process is rank 0 and starts the others as scripts (the first launch),
        watched by :class:`ScriptRanks` instead of Lightning's observer."""
        strategy = self._strategy
        self._script = _compat.SubprocessScriptLauncher(
            strategy.cluster_environment, strategy.num_processes, strategy.num_nodes
        )
        if self._scripts is None:  # (the scripts start once: at the first launch)
            first = strategy.node_rank * strategy.num_processes
            self._scripts = ScriptRanks(
                strategy.rank_name, first, os.environ[REPORTS_ENV],
                lambda lost: lost_rank_message(lost, self._trainer, self._started),
                survive=getattr(strategy, "survives_lost_workers", False),
            )  # fmt: skip
        with self._scripts.watching():
            return self._script.launch(function, *args, trainer=trainer, **kw)

    @override
    def kill(self, signum: Any) -> None:
        if self._script is not None:
            self._script.kill(signum)
        super().kill(signum)

    @override
    def _wrapping_function(self, process_idx: int, trainer, function, args, kwargs, queue, *rest):
        die_with_parent()
        if self._start_method == "fork":
            limit_threads_after_fork(self.plan.threads_per_rank if self.plan else 1)
        elif self._start_method == "forkserver":
            self._parent.restore()
            # The model arrived pickled through shared memory: every rank would step the
            # SAME parameters (each update applied once per rank: measured 2x on 2 ranks).
            # Lightning unshares them for "spawn" only.
            args, kwargs = _compat.disable_module_memory_sharing((args, kwargs))
        self._queue = queue  # (a survivor that takes over rank 0's share sends the results)
        try:
            return super()._wrapping_function(process_idx, trainer, function, args, kwargs,
                                              queue, *rest)  # fmt: skip
        except BaseException as error:  # (Lightning's on_exception runs in the main process)
            self._strategy.describe_failure(error)
            if self._rank_errors is not None and not isinstance(error, KeyboardInterrupt):
                self._rank_errors.save(process_idx, error)
            # failed: the launcher's SIGTERM now just ends this rank (Lightning's handler
            # would broadcast to peers that are gone, adding gloo's traceback to the log)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if isinstance(error, KeyboardInterrupt):  # torch's rank wrapper swallows it and
                # exits 0 with no result: the main process would wait for one forever
                raise RuntimeError(f"rank {process_idx} was interrupted") from error
            raise

    @property
    def carries_back(self) -> bool:
        """Whether this launch starts ranks whose results the main process must be sent."""
        return self.plan is not None and self.plan.method != "popen"

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Any:
        extra = self.get_extra_results(trainer)
        return output_for_script(self._strategy, trainer, results, extra, self._queue)

    @override
    def _recover_results_in_main_process(self, worker_output: Any, trainer: pl.Trainer) -> None:
        rest = recover_in_script(self._strategy, trainer, worker_output)
        super()._recover_results_in_main_process(rest, trainer)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_script"] = None
        return state


def _device_count(device: str) -> int | None:
    import torch

    module = getattr(torch, device, None)
    count = getattr(module, "device_count", None)
    return count() if callable(count) else None


def make_launcher(strategy: Any, requested: str | None) -> Any:
    """The launcher of ``strategy``: none where its cluster starts the ranks (torchrun,
    SLURM, ``run_on_ranks``), else one by the launch policy (``requested``: the user's
    ``start_method``, or None)."""
    env = strategy.cluster_environment
    assert env is not None
    if env.creates_processes_externally:
        return ExistingRanksLauncher(env, strategy.num_processes, strategy.num_nodes)
    return PolicyLauncher(strategy, requested=requested)


def log_startup(name: str, world_size: int, plan: LaunchPlan | None, backend: str) -> None:
    """One line for the whole run (rank 0), instead of one per rank."""
    how = "started by an external launcher" if plan is None else plan.method
    threads = (
        f", {plan.threads_per_rank} thread(s) per rank" if plan and plan.threads_per_rank else ""
    )
    rank_zero_info(f"lightning_par: {name} on {world_size} process(es) ({how}, {backend}{threads})")
