"""Server processes: started by the workers, joined to the workers' process group, ended with it.

ps-lite's server role: the ``S`` servers take ranks ``W .. W+S-1`` of one group with the
``W`` workers, and are spread over the nodes: the worker of local rank 0 on node ``k``
starts servers ``k, k + N, k + 2N, ...`` (``N`` nodes, :func:`servers_of_node`) next to
itself, so the server links do not all end on node 0. This works whichever way the
workers were started (fork, forkserver, popen, torchrun, SLURM): a worker starts its
servers with :func:`~lightning_par.comm.plan_launch` for processes of its own
(``can_exec=False``): ``fork`` where safe, else a clean ``forkserver``. The servers meet
the workers in the job's store (:mod:`lightning_par.launch.rendezvous`), under the group's
own key prefix; gloo then connects every pair directly, on ports the OS gives each process.

A server is a daemon child of the worker that started it, asks Linux to kill it when its
parent dies and watches that worker's pid (a forkserver's child has the forkserver as
parent); one that ``outlive``-s it (fault-tolerant, the store not its starter's) ends at the
survivors' goodbye or as its connections to them all close. The starter watches its servers
(:mod:`.server_watch`): one that dies is reported in the group's store, so every worker's
error names it.

With ``fault_tolerant`` a server's death does not end the job: the starter records how it
ended in the store, a server silent for ``dead_peer_timeout`` is killed by its starter
(:func:`~lightning_par.paramserver.server_watch.fence`) so that its copy takes over
(:mod:`.shard_server`); a lone one has a standby.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.util
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any

import torch.distributed as dist

from lightning_par.comm import CommError, Communicator
from lightning_par.launch import peer_loss
from lightning_par.launch.heartbeat import Heartbeat, report_and_exit
from lightning_par.launch.lost import REPORTS_ENV, leave_report
from lightning_par.launch.parent_state import ParentState
from lightning_par.launch.policy import FORKSERVER_PRELOAD, limit_threads_after_fork, plan_launch
from lightning_par.launch.processes import die_with_parent, forkserver_context
from lightning_par.launch.rendezvous import StoreAddress, connect_group_store, dead_peer_timeout
from lightning_par.paramserver.asynchronous import serve_async
from lightning_par.paramserver.faults import record_fault, with_fault
from lightning_par.paramserver.lost_workers import let_go_silent
from lightning_par.paramserver.server import serve, synchronous_step
from lightning_par.paramserver.shard_server import serve_replicated


def _watch(pid: int) -> None:
    while True:
        time.sleep(0.5)
        try:
            os.kill(pid, 0)
        except OSError:  # worker 0 is gone: so is the job
            os._exit(1)


def servers_of_node(num_servers: int, num_nodes: int, node_rank: int) -> list[int]:
    """The servers node ``node_rank`` starts: every ``num_nodes``-th, from its own index."""
    return list(range(node_rank, num_servers, max(1, num_nodes)))


@dataclass(frozen=True)
class ServerLaunch:
    """Everything one server process needs to start (sent to it by the worker that starts it;
    plain values, picklable for a forkserver or spawn start)."""

    server: int  # its index among the servers (group rank ``num_workers + server``)
    num_workers: int
    num_servers: int  # server processes (fault_tolerant with one server: 2, the standby)
    address: StoreAddress  # the group's store
    timeout: timedelta  # the group's timeout: one unit from the strategy to the socket
    owner: int  # the pid of the worker that started it (the server dies with it)
    threads: int = 1
    asynchronous: bool = False
    staleness: int | None = None
    remedies: Any = None  # a lightning_par.paramserver.remedies.Remedies (asynchronous)
    dead_peer_s: float | None = None  # the strategy's dead_peer_timeout (None: the default)
    fault_tolerant: bool = False
    outlive: bool = False  # outlive its starter (fault_tolerant, where the store outlives it)

    @property
    def rank(self) -> int:
        return self.num_workers + self.server


def server_main(launch: ServerLaunch, parent: ParentState | None = None) -> None:
    """A server process: join the group as rank ``W + server`` and serve until told to stop.
    ``parent``: the starting worker's state, restored in a forkserver's child."""
    if not launch.outlive:  # (else it outlives worker 0, whose share a survivor takes)
        die_with_parent()
        threading.Thread(target=_watch, args=(launch.owner,), daemon=True).start()
    # a server ends with its worker: a SIGTERM to the worker's process group (torchrun's
    # agent stopping the job) is the worker's to handle; a server it killed would be taken
    # for the process the job lost
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if parent is not None:
        parent.restore()
    limit_threads_after_fork(max(1, launch.threads))
    server, num_workers, rank = launch.server, launch.num_workers, launch.rank
    timeout = launch.timeout
    beat: Heartbeat | None = None
    try:
        store = connect_group_store(launch.address, timeout)
        dist.init_process_group(
            "gloo", store=store, rank=rank,
            world_size=num_workers + launch.num_servers, timeout=timeout,
        )  # fmt: skip
        dist.new_group(list(range(num_workers)))  # the workers' group: every rank takes part
        # every rank (asynchronous: the workers it loses are forgotten as it drops them)
        watched = range(num_workers + launch.num_servers)
        limit = dead_peer_timeout(timeout, launch.dead_peer_s)
        beat = Heartbeat(store, rank, watched, limit, partial(role_name, num_workers))
        # fault_tolerant: a silent server is killed by its starter and its copy takes over; a
        # silent worker is ended (here, if it runs on this machine) and let go
        if launch.fault_tolerant:
            beat.survive = partial(let_go_silent, beat, num_workers, launch.outlive)
        # (asynchronous: no worker watches the workers other than 0, which it may lose)
        beat.on_dead = partial(_peer_silent, beat, num_workers if launch.asynchronous else 0)
        beat.start()
        if launch.asynchronous:
            serve_async(Communicator(), server, launch.staleness, launch.remedies, beat.forget)
        elif launch.fault_tolerant:
            serve_replicated(Communicator(), server, launch.num_servers, store, timeout)
        else:
            serve(Communicator(), server, with_fault(server, synchronous_step))
    except BaseException as err:
        record_fault(str(err) if f"rank {rank}" in str(err) else f"server rank {rank}: {err}")
        # a peer lost or hung: the launcher's line names it (a launch of this project), or
        # the workers' (another launch); the traceback of this echo would only hide it
        named = os.environ.get(REPORTS_ENV) or (
            beat is not None and (peer_loss.handed_over(beat) or peer_loss.lost_peer(beat))
        )  # fmt: skip
        if not (isinstance(err, CommError) and named):
            print(
                f"parameter server {server} (rank {rank}) failed:\n{traceback.format_exc()}",
                file=sys.stderr, flush=True,
            )  # fmt: skip
        os._exit(1)  # do not wait for peers that may be gone
    beat.stop()
    dist.destroy_process_group()


def _peer_silent(beat: Heartbeat, unwatched_below: int, peer: int, report: str) -> None:
    """A server's heartbeat found ``peer`` silent. The launcher of this project names it, if
    one waits (the server ends); else a peer the workers watch is theirs to name, and the
    server ends with the worker that started it. Workers ``1 .. unwatched_below - 1``
    (``async_sgd``'s, which no worker watches) this server hands over instead
    (:func:`~lightning_par.launch.peer_loss.hand_over_silent`: killed, its report
    left for the workers) and ends, so that the workers' next step fails and names it; or,
    where it cannot be killed (another machine), says it itself."""
    if leave_report(peer, report):
        os._exit(1)
    if 0 < peer < unwatched_below:
        if peer_loss.hand_over_silent(beat, peer, report):
            os._exit(1)
        report_and_exit(beat.name(beat.rank), peer, report)


def role_name(num_workers: int, rank: int) -> str:
    """``worker r (rank r)`` or ``parameter server s (rank W+s)``, for reports."""
    if rank < num_workers:
        return f"worker {rank} (rank {rank})"
    return f"parameter server {rank - num_workers} (rank {rank})"


def start_servers(
    servers: list[int], num_workers: int, num_servers: int, address: StoreAddress,
    timeout: timedelta, asynchronous: bool = False, staleness: int | None = None,
    remedies: Any = None, dead_peer_s: float | None = None, fault_tolerant: bool = False,
    outlive: bool = False,
) -> list[mp.process.BaseProcess]:  # fmt: skip
    """Start ``servers`` (indices out of ``num_servers``) from this worker, before it joins
    the group at ``address``; with ``asynchronous`` they run
    :func:`~lightning_par.paramserver.asynchronous.serve_async` (with ``remedies``, a
    :class:`~lightning_par.paramserver.remedies.Remedies`)."""
    plan = plan_launch("cpu", max(1, len(servers)), can_exec=False)
    ctx = mp.get_context(plan.method)
    if plan.method == "forkserver":
        ctx = forkserver_context(FORKSERVER_PRELOAD)
    daemonic = not mp.current_process().daemon  # a daemon may not start daemons
    procs = []
    for s in servers:
        # One intra-op thread: worker 0 may itself be a fork of a process whose OpenMP pool
        # had started, and libgomp hangs a grandchild's first multi-threaded region (seen
        # with Adam on a server); a server's element-wise update needs no more.
        launch = ServerLaunch(
            s, num_workers, num_servers, address, timeout, os.getpid(), threads=1,
            asynchronous=asynchronous, staleness=staleness, remedies=remedies,
            dead_peer_s=dead_peer_s, fault_tolerant=fault_tolerant, outlive=outlive,
        )  # fmt: skip
        proc = ctx.Process(
            target=server_main,
            args=(launch, ParentState()),
            daemon=daemonic,
            name=f"ps-server-{s}",
        )
        proc.start()
        proc.server_index = s  # type: ignore[attr-defined]
        procs.append(proc)
    # Runs as this worker exits, before multiprocessing joins its non-daemon children (a
    # fork-launched rank is a daemon, so its servers are not): a rank that fails skips
    # teardown, and its servers would wait for the next message for the whole timeout.
    mp.util.Finalize(None, _kill_left, args=(procs, os.getpid()), exitpriority=100)
    return procs


def _kill_left(procs: list[mp.process.BaseProcess], owner: int) -> None:
    if os.getpid() != owner:  # a plain os.fork of the worker inherits the finalizer
        return
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
