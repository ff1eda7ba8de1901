"""The starter's watch over the server processes it started (:mod:`.process`): a server that
dies is reported in the group's store, so every worker's error names it
(:func:`watch_servers`, :func:`name_dead_server`); with ``fault_tolerant`` a server silent
for ``dead_peer_timeout`` is killed by its starter so that its copy takes over
(:func:`fence`); at the end the servers told to stop are waited for (:func:`stop_servers`).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import signal
import threading
import time

from lightning_par.launch.liveness import current
from lightning_par.launch.lost import how_it_ended
from lightning_par.paramserver.faults import lost_server, record_fault, record_lost, reported_fault
from lightning_par.paramserver.lost_workers import end_silent_worker
from lightning_par.paramserver.process import role_name

#: Marks a server's death in the message :func:`watch_servers` leaves for the workers.
DIED = "; the job cannot go on without its shard of the parameters"


def watch_servers(
    procs: list[mp.process.BaseProcess], num_workers: int, fault_tolerant: bool = False
) -> threading.Event:
    """Report a server of ``procs`` that dies before it is told to stop (set the returned
    event first): its index, rank and how it ended go to the group's store, where every
    worker's error message finds them (``fault_tolerant``: where its peers learn that it is
    lost, :func:`~lightning_par.paramserver.faults.record_lost`). Call once this process
    has joined the group."""
    stopping = threading.Event()

    def watch() -> None:
        left = {proc.sentinel: proc for proc in procs}
        while left and not stopping.is_set():
            for sentinel in mp.connection.wait(list(left), timeout=0.5):
                proc = left.pop(sentinel)
                proc.join()
                s = proc.server_index  # type: ignore[attr-defined]
                if fault_tolerant and not stopping.is_set() and proc.exitcode != 0:
                    if lost_server(s, grace_s=0) is None:  # (fenced: said so already)
                        record_lost(s, _how_it_ended(proc.exitcode))
                    continue
                if stopping.is_set() or proc.exitcode == 0 or reported_fault(grace_s=0):
                    continue  # (a server that failed on its own said why already)
                record_fault(
                    f"parameter server {s} (rank {num_workers + s}), process {proc.pid}, "
                    f"{_how_it_ended(proc.exitcode)}{DIED}"
                )

    threading.Thread(target=watch, daemon=True, name="ps-server-watch").start()
    return stopping


def fence(procs: list[mp.process.BaseProcess], num_workers: int, zero: bool = False):
    """A worker's answer to a silent peer (``fault_tolerant``): the job goes on without a
    server (``survive`` of :class:`~lightning_par.launch.heartbeat.Heartbeat`), killed first
    if this worker started it, so that its connections close and its copy takes over, and
    without a worker (0 if ``zero``: its servers outlive it), killed first where it runs."""

    def survive(peer: int, report: str) -> bool:
        beat = current()
        if (peer > 0 or zero) and peer < num_workers and beat is not None:  # ended, let go
            end_silent_worker(beat, peer, report)
            return True
        for proc in procs:
            if num_workers + proc.server_index == peer and proc.is_alive():  # type: ignore[attr-defined]
                how = report.removeprefix(role_name(num_workers, peer)).strip()
                record_lost(peer - num_workers, f"{how}, and its starter killed it")
                proc.kill()
        return peer >= num_workers

    return survive


def _how_it_ended(exitcode: int) -> str:
    why = " (as the OOM killer does)" if exitcode == -signal.SIGKILL else ""
    return how_it_ended(exitcode) + why


def name_dead_server(error: BaseException, rank: int) -> None:
    """If a server died (killed outright, say by the OOM killer), make ``error`` say so,
    naming it, instead of gloo's "Connection closed by peer" chain (in worker ``rank``)."""
    fault = reported_fault(grace_s=3.0)
    if fault and fault.startswith("parameter server") and DIED in fault:
        error.args = (f"worker {rank}: {fault}",)
        error.__cause__, error.__suppress_context__ = None, True


def stop_servers(procs: list[mp.process.BaseProcess], wait_s: float = 10.0) -> None:
    """Wait for servers that were told to stop; kill any still running after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
