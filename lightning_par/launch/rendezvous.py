"""Process-group set-up: where ranks meet, and how long a group waits for a peer.

**Where ranks meet.** Every group of a strategy meets in one key-value store per job (a
``TCPStore``), each group under its own key prefix, so that a second group in the same
processes (``fit`` then ``test``; a parameter-server group of workers and servers) never
reads the keys of the first:

* a launch by this project (fork, forkserver, popen on one machine): the launching
  process binds the store's socket on a port the OS gives it (port 0) *before* any rank
  starts, has a small process of its own serve the store on it for the launcher's whole
  life (:mod:`~lightning_par.launch.store_host`: why not a thread), then tells the ranks its
  address in ``LIGHTNING_PAR_STORE``. A port found free and bound later by a rank can be
  taken in between by another job started at the same moment; a port bound from the start
  cannot;
* torchrun: the agent's store at ``MASTER_ADDR:MASTER_PORT`` (``TORCHELASTIC_USE_AGENT_STORE``);
* SLURM and any other launcher: global rank 0 starts the store's host process at
  ``MASTER_ADDR:MASTER_PORT`` (Lightning's ``SLURMEnvironment`` derives the port from the
  job id).

**How long.** :func:`default_timeout` (30 min, as torch's, or ``LIGHTNING_PAR_TIMEOUT``)
bounds how long a collective waits for a peer that is alive but busy (a rank writing a
checkpoint, compiling its first step). A peer that *died* is reported within seconds:
gloo fails at once when its connection closes, and :mod:`lightning_par.launch.liveness`
reports a peer that stopped answering (frozen, its machine gone) after
:func:`dead_peer_timeout`.
"""

from __future__ import annotations

import atexit
import itertools
import os
import socket
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from lightning_par.launch.store_host import StoreHost, job_store_host

#: Seconds a collective or receive may wait for a live peer. Override with the environment
#: variable ``LIGHTNING_PAR_TIMEOUT`` or a strategy's ``timeout`` option.
DEFAULT_TIMEOUT_S = 1800.0
#: The limit of :func:`~lightning_par.comm.run_on_ranks` (tests, notebooks: short runs).
RUN_TIMEOUT_S = 60.0
#: Seconds without a heartbeat after which a peer is reported dead (a strategy's
#: ``dead_peer_timeout``, else ``LIGHTNING_PAR_DEAD_PEER_S``); never more than the timeout.
#: Why a minute: the heartbeat beats from a thread of its own, so a slow step, a long
#: checkpoint write or a rank waiting in a collective never stops it; only a pause of the
#: whole process does (one C call that holds the GIL, as pickling one large Python object; a
#: node swapping or a loaded CI machine descheduling it; a stop-the-world collection), and
#: those last seconds to tens of seconds. A minute is well clear of them, and it is what a
#: real freeze costs before the job ends, against the collective timeout's 30 minutes. A
#: cluster with fast nodes can take less (torchelastic's rendezvous counts a node dead
#: after three missed 5 s keep-alives); tests use a few seconds.
DEAD_PEER_S = 60.0
#: The environment variable that sets :data:`DEAD_PEER_S` for a whole job.
DEAD_PEER_ENV = "LIGHTNING_PAR_DEAD_PEER_S"
#: The store a launch of this project holds for its ranks: ``host:port/launch-id``.
STORE_ENV = "LIGHTNING_PAR_STORE"
#: Set (to ``1``) where the job's store is served by a keeper that outlives rank 0 (a
#: ``popen`` launch's, :mod:`~lightning_par.launch.script_keeper`; rank 0's under SLURM,
#: :mod:`~lightning_par.launch.keeper`): rank 0's end is not the store's.
KEPT_STORE_ENV = "LIGHTNING_PAR_KEPT_STORE"


def default_timeout(default_s: float = DEFAULT_TIMEOUT_S) -> timedelta:
    return timedelta(seconds=float(os.environ.get("LIGHTNING_PAR_TIMEOUT", default_s)))


def dead_peer_timeout(timeout: timedelta | None = None, given_s: float | None = None) -> float:
    """Seconds of silence after which a peer counts as dead: ``given_s`` (a strategy's
    ``dead_peer_timeout``), else :data:`DEAD_PEER_ENV`, else :data:`DEAD_PEER_S`; at most
    ``timeout``."""
    limit = float(os.environ.get(DEAD_PEER_ENV, DEAD_PEER_S)) if given_s is None else given_s
    return min(limit, timeout.total_seconds()) if timeout is not None else limit


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free on ``host`` (loopback by default, never a fixed number)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class RendezvousTimeout(RuntimeError):
    """A rank found no job store to meet its peers in within its timeout."""


@dataclass(frozen=True)
class StoreAddress:
    """Where one process group meets: a job store and the key prefix of this group."""

    host: str
    port: int
    prefix: str


_joined: dict[tuple[int, str, int], dist.Store] = {}  # (pid, host, port) -> this process's
_served: list = []  # store hosts this rank started (global rank 0 outside our launches)
_groups = itertools.count()  # groups this process has joined: the next group's prefix
_host_rank: int | None = None  # the rank whose process serves the job's store (see below)


def _release_stores() -> None:
    """Close this process's store connections while the interpreter is whole (registered
    at import, so it runs after the heartbeat and the process group have stopped at exit)."""
    _joined.clear()


atexit.register(_release_stores)


def host_job_store(host: str = "127.0.0.1") -> str:
    """Launcher side: the address of a store bound on a port the OS picked, served by a
    process of its own (:mod:`~lightning_par.launch.store_host`), for the ranks:
    ``host:port/launch-id`` (a new launch id per call keeps each launch's keys apart)."""
    served = job_store_host(host)
    return f"{host}:{served.port}/{uuid.uuid4().hex[:8]}"


def _cluster_main(main: tuple[str, int] | None) -> tuple[str, int]:
    """Where a job's ranks meet outside this project's launches: the cluster environment's
    main address and port when the strategy has one (``main``; Lightning's
    ``SLURMEnvironment`` derives the port from ``SLURM_JOB_ID``, since ``srun`` sets no
    ``MASTER_PORT``), else ``MASTER_ADDR``/``MASTER_PORT``."""
    if main is not None:
        return main[0], int(main[1])
    if "MASTER_PORT" not in os.environ:
        raise RuntimeError(
            "lightning_par: no rendezvous for this process group: it was not started by a "
            "lightning_par launch (LIGHTNING_PAR_STORE), MASTER_PORT is not set and no cluster "
            "environment gave a port. Set MASTER_ADDR and MASTER_PORT, or launch through "
            "Trainer(strategy=...), torchrun or srun"
        )
    return os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])


def _job_store(
    rank: int, timeout: timedelta, spec: str | None, main: tuple[str, int] | None = None
) -> tuple[dist.Store, str, int, str]:
    spec = spec or os.environ.get(STORE_ENV)
    if spec:
        where, launch = spec.rsplit("/", 1)
        host, port_text = where.rsplit(":", 1)
        port, master = int(port_text), False
    else:
        (host, port), launch = _cluster_main(main), "job"
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        served_by_rank_0 = not agent and not os.environ.get(KEPT_STORE_ENV)
        master = rank == 0 and served_by_rank_0
        global _host_rank
        _host_rank = 0 if served_by_rank_0 else None
    key = (os.getpid(), host, port)
    if key not in _joined:  # (a forked child must not use its parent's connection)
        if master:  # served by a process of its own: this rank may fork (parameter servers)
            _served.append(StoreHost(host, port, bind=""))
        try:
            _joined[key] = dist.TCPStore(
                host, port, is_master=False, wait_for_workers=False, timeout=timeout
            )
        except (RuntimeError, OSError) as err:  # (torch's DistNetworkError: a RuntimeError)
            raise RendezvousTimeout(
                f"rank {rank}: no job store at {host}:{port} after "
                f"{timeout.total_seconds():.0f} s ({str(err).splitlines()[0]}). Global rank 0 "
                "serves it: is rank 0 running, and can this node reach that address? Under "
                "SLURM the port is 15000 + the last four digits of SLURM_JOB_ID (Lightning's "
                "SLURMEnvironment); set MASTER_PORT to choose another"
            ) from err
    return _joined[key], host, port, launch


def serve_job_store_outliving_rank_0(host: str, port: int) -> None:
    """Rank 0, before it becomes its keeper (:mod:`.keeper`): start the job's store host
    now, so that it is the keeper's and outlives the rank (a fault-tolerant run under
    SLURM goes on without rank 0). The rank then joins the store as a client."""
    _served.append(StoreHost(host, port, bind=""))
    job_store_outlives_rank_0()


def job_store_outlives_rank_0() -> None:
    """Every other rank of such a job: rank 0's keeper serves the store, so rank 0's end is
    not the store's (its heartbeat goes on watching the others, and the survivors regroup).
    Said in the environment (:data:`KEPT_STORE_ENV`), which the run of the script that the
    rank's keeper starts inherits (:mod:`.keeper`)."""
    os.environ[KEPT_STORE_ENV] = "1"


def store_host_rank() -> int | None:
    """The rank whose process serves the job's store, when a rank does: global rank 0
    under SLURM and other launchers (its store host dies with it). None where a process
    that outlives every rank serves it (a launch of this project, torchrun's agent, rank
    0's keeper: :func:`serve_job_store_outliving_rank_0`); a
    ``popen`` launch's scripts say their launching rank in ``LIGHTNING_PAR_LAUNCHER_RANK``,
    unless its keeper serves the store (:data:`KEPT_STORE_ENV`)."""
    return _host_rank


def group_store(
    rank: int,
    timeout: timedelta,
    spec: str | None = None,
    main: tuple[str, int] | None = None,
) -> tuple[dist.Store, StoreAddress]:
    """The store of the next process group this rank joins, and its address (to give to
    processes this rank starts for the same group, e.g. parameter servers). ``spec``: the
    store a launcher of this project holds (default ``LIGHTNING_PAR_STORE``; else the
    cluster's, see the module docstring). Every rank must join its groups in the same
    order (they do: each runs the same script). ``main``: the cluster environment's
    ``(main_address, main_port)``, used when no launcher of this project holds the store."""
    store, host, port, launch = _job_store(rank, timeout, spec, main)
    address = StoreAddress(host, port, f"lightning_par/{launch}/{next(_groups)}")
    return dist.PrefixStore(address.prefix, store), address


def connect_group_store(address: StoreAddress, timeout: timedelta) -> dist.Store:
    """A process started for a group (a server): the group's store, as a client."""
    store = dist.TCPStore(
        address.host, address.port, is_master=False, wait_for_workers=False, timeout=timeout
    )
    return dist.PrefixStore(address.prefix, store)


def init_process_group(
    rank: int,
    world_size: int,
    *,
    backend: str = "gloo",
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    rendezvous_file: str | None = None,
    timeout: timedelta | None = None,
) -> None:
    """``dist.init_process_group`` with this project's default timeout, meeting over TCP
    at ``master_addr:master_port`` or, for ranks on one machine, in ``rendezvous_file``.

    A file needs no port: a port found free and bound a moment later by the rendezvous can
    be taken in between by another job on the machine, whose ranks then meet ours in the
    same store (seen as gloo's "connectFullMesh failed ... Connection closed by peer").
    """
    if (master_port is None) == (rendezvous_file is None):
        raise ValueError("pass exactly one of master_port and rendezvous_file")
    init = f"tcp://{master_addr}:{master_port}" if rendezvous_file is None else (
        f"file://{rendezvous_file}"
    )  # fmt: skip
    dist.init_process_group(
        backend=backend,
        init_method=init,
        rank=rank,
        world_size=world_size,
        timeout=timeout or default_timeout(RUN_TIMEOUT_S),
    )
    wait_until_connected(backend)


def wait_until_connected(backend: str) -> None:
    """Return once every rank of the new default group has connected its side of it.

    gloo's rendezvous returns in a rank once *its* connections are up, possibly while a
    slower rank still completes its side: a rank that then ends the group at once (a
    function that sends nothing, a call kept no longer) leaves that rank with "Connection
    closed by peer" (seen under load on 2 cores). A barrier closes that gap. NCCL connects
    at the first collective, so it has no such gap."""
    if backend == "gloo":
        dist.barrier()
