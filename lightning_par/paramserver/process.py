"""Server processes: started by worker 0, joined to the workers' process group, ended with it.

Worker 0 (global rank 0, on the first node) starts the ``S`` servers just before it joins
the process group of ``W + S`` ranks; the servers take ranks ``W .. W+S-1``. This works the
same whichever way the workers were started (fork, popen, torchrun, SLURM): only worker 0
starts processes, from its own address and port. How: :func:`~lightning_par.comm.plan_launch`
with ``can_exec=False`` says ``fork`` where safe, else a clean ``forkserver``.

Ending with the job: a server is a daemon child of worker 0 (killed when worker 0 exits),
asks Linux to kill it when its parent dies, and watches worker 0's process id (a
forkserver's child has the forkserver as parent), so no server outlives a failed run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
from datetime import timedelta

from lightning_par.comm.launch import FORKSERVER_PRELOAD, limit_threads_after_fork, plan_launch
from lightning_par.comm.run import die_with_parent


def _watch(pid: int) -> None:
    while True:
        time.sleep(0.5)
        try:
            os.kill(pid, 0)
        except OSError:  # worker 0 is gone: so is the job
            os._exit(1)


def server_main(
    server: int, num_workers: int, num_servers: int, address: str, port: int,
    timeout_s: float, threads: int, owner: int, asynchronous: bool = False,
    staleness: int | None = None,
) -> None:  # fmt: skip
    """A server process: join the group as rank ``W + server`` and serve until told to stop."""
    import torch.distributed as dist

    from lightning_par.comm import Communicator
    from lightning_par.paramserver.faults import record_fault, with_test_exit
    from lightning_par.paramserver.server import serve, synchronous_step

    die_with_parent()
    threading.Thread(target=_watch, args=(owner,), daemon=True).start()
    limit_threads_after_fork(max(1, threads))
    rank = num_workers + server
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://{address}:{port}", rank=rank,
            world_size=num_workers + num_servers, timeout=timedelta(seconds=timeout_s),
        )  # fmt: skip
        dist.new_group(list(range(num_workers)))  # the workers' group: every rank takes part
        if asynchronous:
            from lightning_par.paramserver.asynchronous import serve_async

            serve_async(Communicator(), server, staleness)
        else:
            serve(Communicator(), server, with_test_exit(server, synchronous_step))
    except BaseException as err:
        record_fault(str(err) if f"rank {rank}" in str(err) else f"server rank {rank}: {err}")
        print(
            f"parameter server {server} (rank {rank}) failed:\n{traceback.format_exc()}",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        os._exit(1)  # do not wait for peers that may be gone
    dist.destroy_process_group()


def start_servers(
    num_workers: int, num_servers: int, address: str, port: int, timeout: timedelta,
    asynchronous: bool = False, staleness: int | None = None,
) -> list[mp.process.BaseProcess]:  # fmt: skip
    """Start the servers (call on worker 0 before it joins the process group); with
    ``asynchronous`` they run :func:`~lightning_par.paramserver.asynchronous.serve_async`."""
    plan = plan_launch("cpu", num_servers, can_exec=False)
    ctx = mp.get_context(plan.method)
    if plan.method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    daemonic = not mp.current_process().daemon  # a daemon may not start daemons
    procs = []
    for s in range(num_servers):
        # One intra-op thread: worker 0 may itself be a fork of a process whose OpenMP pool
        # had started, and libgomp hangs a grandchild's first multi-threaded region (seen
        # with Adam on a server); a server's element-wise update needs no more.
        args = (s, num_workers, num_servers, address, port, timeout.total_seconds(), 1,
                os.getpid(), asynchronous, staleness)  # fmt: skip
        proc = ctx.Process(target=server_main, args=args, daemon=daemonic, name=f"ps-server-{s}")
        proc.start()
        procs.append(proc)
    return procs


def stop_servers(procs: list[mp.process.BaseProcess], wait_s: float = 10.0) -> None:
    """Wait for servers that were told to stop; kill any still running after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
