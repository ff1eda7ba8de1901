"""A lost peer named by the ranks themselves, where no launcher of this project can: under
torchrun or SLURM, and in the scripts of a ``popen`` launch whose lost rank is rank 0 (the
launching process itself).

torchrun's agent sees a rank end, stops the others (SIGTERM, SIGKILL 30 s later) and prints
its failure table, while each surviving rank fails in a collective with gloo's "Connection
reset by peer" under a traceback of this project's internals; a frozen rank the agent does
not see at all (it is alive). So a rank that another launcher started does within itself
what a launch of this project does (:mod:`._lost_ranks`), with :class:`LostPeers`:

* a peer its heartbeat finds silent for ``dead_peer_timeout`` is killed if it runs on this
  machine, so that the collective waiting on it fails at once (and torchrun's agent sees it
  end); on another machine, where it cannot be, this rank says so and ends (a blocked
  collective cannot be interrupted from Python);
* when this rank fails, a peer whose process ended without finishing its stage
  (:func:`~lightning_par.launch.peer_loss.lost_peer`), or the silent one, is the
  cause: the first rank to see it prints one line at once (torchrun's agent may end it any
  moment after), and ``fit`` raises :class:`~lightning_par.launch.lost.RankLost` holding
  that line, which a script that does not catch it does not print again;
* where a launcher of this project waits (``popen``'s scripts, the lost rank not rank 0)
  the rank stays quiet: that launcher names the lost rank, with its exit code.

A rank of a strategy with ``fault_tolerant=True`` is kept apart from torchrun's agent and
``srun`` by :func:`keep_from_launcher` (:mod:`lightning_par.launch.keeper`): they would
stop the survivors as soon as one rank ended by a signal.

While this rank looks for the lost peer and ends, a SIGTERM (torchrun's agent stopping the
job) is held back: Lightning's handler of it broadcasts on the group whose peer is gone, and
its error would take the place of the lost rank's line.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

from lightning_par import _compat
from lightning_par.launch import keeper, liveness, peer_loss, rendezvous, script_keeper
from lightning_par.launch.lost import (
    RankLost,
    launcher_names,
    leave_report,
    one_line_when_uncaught,
)
from lightning_par.strategies._interrupts import checkpoint_clause

log = logging.getLogger("lightning_par")

#: Whether this process launched ranks already (:func:`keep_popen_rank_0`).
_launched = False
#: Seconds this rank's collective gets to fail once a silent peer was killed, before this
#: rank says so and ends by itself (its main thread computes alone, say).
FAIL_WITHIN_S = 5.0


class LostPeers:
    """The lost peers of a rank started by another launcher (see the module docstring)."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.started = time.time()
        self.silent: RankLost | None = None  # the peer the heartbeat found silent
        self.handled = threading.Event()  # the main thread named the lost peer

    @contextmanager
    def watching(self, trainer: Any) -> Iterator[None]:
        """While a ``Trainer`` call runs in this rank: a failure caused by a lost peer
        becomes one line and a :class:`RankLost`."""
        self.trainer, self.started, self.silent = trainer, time.time(), None
        self.handled.clear()
        with liveness.silent_peers_handed_to(self.peer_silent):
            try:
                yield
            except BaseException as error:
                lost = self.cause_of(error)
                if lost is None:
                    raise
                raise lost from None

    def line(self, lost: RankLost) -> str:
        return f"{lost}; the job ends{checkpoint_clause(self.trainer, self.started)}"

    def cause_of(self, error: BaseException) -> RankLost | None:
        """The lost peer that made this rank fail with ``error``, as a :class:`RankLost`
        holding the one line (printed here by the first rank to see it), or None."""
        if isinstance(error, KeyboardInterrupt):
            return None
        held = _HeldSigterm()
        beat = liveness.current()
        lost = error if isinstance(error, RankLost) and not error.said else self.silent
        if lost is None and beat is not None:
            found = peer_loss.handed_over(beat) or peer_loss.lost_peer(beat)
            lost = RankLost(found[1], found[0]) if found is not None else None
        if lost is None:
            held.release()
            return None
        self.handled.set()
        named = RankLost(self.line(lost), lost.rank, "".join(traceback.format_exception(error)))
        log.debug("lightning_par: %s; this rank failed with:\n%s", named, named.details)
        if not launcher_names(lost.rank) and (beat is None or peer_loss.first_to_report(beat)):
            print(f"lightning_par: {named}", file=sys.stderr, flush=True)
        named.said = True
        one_line_when_uncaught()
        return named

    def peer_silent(self, rank: int, report: str) -> None:
        """The heartbeat (on its own thread) found ``rank`` silent (see the module
        docstring)."""
        if leave_report(rank, report):  # a launcher of this project names it
            os._exit(1)
        self.silent = RankLost(report, rank)
        beat = liveness.current()
        killed = beat is not None and peer_loss.hand_over_silent(beat, rank, report)
        # the main thread's collective fails on the killed peer and names it; else this
        # thread does, after a while (a collective cannot be interrupted from Python)
        ending = threading.Timer(FAIL_WITHIN_S if killed else 0.0, self._end, (self.silent,))
        ending.daemon = True
        ending.start()

    def _end(self, lost: RankLost) -> None:
        if not self.handled.is_set():
            print(f"lightning_par: {self.line(lost)}", file=sys.stderr, flush=True)
            os._exit(1)


def keep_from_launcher(strategy: Any) -> None:
    """Under torchrun or SLURM, run this rank behind a keeper once
    (:mod:`lightning_par.launch.keeper`) if the strategy is ``fault_tolerant``. The keeper
    tells the launcher that a lost rank ended well if the job goes on without it: a rank
    other than 0, or rank 0 of a strategy whose first survivor takes over rank 0's share
    (``survives_lost_rank_zero``). Under torchrun the agent holds the job's store; under
    SLURM rank 0's keeper serves it, and stays until every rank ended."""
    external = (TorchElasticEnvironment, SLURMEnvironment)
    resilience = getattr(strategy, "resilience", None)
    if keeper.kept() or resilience is None or not resilience.enabled:
        return  # (async_sgd's lost worker ends the job under these launchers, as it did)
    if not isinstance(strategy.cluster_environment, external):
        return
    rank, env = strategy.global_rank, strategy.cluster_environment
    takes_over = getattr(strategy, "survives_lost_rank_zero", False)
    after = None
    if takes_over and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        # rank 0 serves the job's store (SLURM): its keeper serves it instead, until every
        # rank ended, so that the survivors keep it when rank 0 is lost
        address = (env.main_address, env.main_port)
        if rank == 0:
            rendezvous.serve_job_store_outliving_rank_0(*address)
        else:
            rendezvous.job_store_outlives_rank_0()
        world = strategy.world_size if rank == 0 else None
        after = partial(keeper.count_end, *address, world)
    command, cwd = _compat.script_command(strategy.local_rank)
    replaceable = getattr(strategy, "admits_replacements", False)  # (see .keeper)
    keeper.keep(strategy.rank_name(rank), rank != 0 or takes_over, command, cwd, after,
                replaceable)  # fmt: skip


def keep_popen_rank_0(strategy: Any, method: str) -> None:
    """At a launch by ``method``: under ``popen`` (this process is the user's script and
    would be rank 0), where the strategy survives rank 0's loss (``fault_tolerant``,
    ``survives_lost_rank_zero``), become rank 0's keeper, which never returns
    (:mod:`lightning_par.launch.script_keeper`); rank 0 and the scripts it starts return.
    Only at this process's first launch: rank 0, a run of the script, would launch again
    what this process launched before (a later ``popen`` launch finds its ranks started)."""
    global _launched
    first, _launched = not _launched, True
    if method != "popen" or not first:
        return
    resilience = getattr(strategy, "resilience", None)
    if resilience is None or not resilience.enabled:
        return
    if not getattr(strategy, "survives_lost_rank_zero", False) or strategy.num_nodes != 1:
        return  # (several nodes: each node's first rank holds its own scripts)
    if script_keeper.runs_behind_keeper() or not script_keeper.can_keep():
        return
    command, cwd = _compat.script_command(0)
    script_keeper.run_rank_0_behind_keeper(strategy.rank_name(0), command, cwd)


class _HeldSigterm:
    """SIGTERM recorded instead of handled (in the main thread), until :meth:`release`;
    left in place when the rank ends (Lightning's teardown restores the handler it found)."""

    def __init__(self) -> None:
        self.received = False
        self.previous: Any = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._record)

    def _record(self, signum: int, frame: Any) -> None:
        self.received = True

    def release(self) -> None:
        """Handle SIGTERM as before again (and one that came meanwhile now)."""
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
            if self.received:
                os.kill(os.getpid(), signal.SIGTERM)
