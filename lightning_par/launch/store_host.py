"""The job store of a launch on one machine, held by a small process of its own.

A launcher of this project binds the store's socket on a port the OS gives it before any
rank starts (so no other job can take that port in between) and hands the bound socket to
a separate process that serves the ``TCPStore`` on it until the launcher exits.

Why a process and not a thread of the launcher: a rank forked from a process that serves a
``TCPStore`` inherits the server's sockets and event loop, and then its own connection to
that store may wait seconds to be accepted (seen here as 1-5 s stalls in about one fork
launch in ten, and as a 20 s rendezvous timeout under load); with the default threaded
backend the forked rank hangs outright. A launcher that serves nothing itself can fork
ranks (and ranks can fork parameter servers) safely. The host starts with ``exec``, so it
inherits nothing but the socket; it imports only ``torch.distributed`` (about 1.5 s, once
per launching process: later launches use their own key prefixes in the same store).
"""

from __future__ import annotations

import atexit
import os
import select
import socket
import subprocess
import sys

#: The host process: serve the store on the inherited socket until the launcher is gone.
_HOST_SCRIPT = """
import ctypes, os, signal, sys, time
fd, host, port, launcher, ready = (int(sys.argv[1]), sys.argv[2], int(sys.argv[3]),
                                   int(sys.argv[4]), int(sys.argv[5]))
signal.signal(signal.SIGINT, signal.SIG_IGN)  # (Ctrl-C reaches the group: the launcher ends it)
if sys.platform.startswith("linux"):
    try:  # SIGKILL this host when the launcher dies, however it dies
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass
import torch.distributed as dist
store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, master_listen_fd=fd)
os.write(ready, b"1")
os.close(ready)
while os.getppid() == launcher:
    time.sleep(0.5)
os._exit(0)
"""


class StoreHost:
    """A ``TCPStore`` served by a child process on a port bound now (``port`` 0: one the OS
    picks); :attr:`port` is final. ``bind``: the interface (default ``host``; ``""``: all,
    for ranks on other machines)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, bind: str | None = None) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host if bind is None else bind, port))
        except OSError as err:
            sock.close()
            raise RuntimeError(
                f"the job's store cannot listen on port {port} of {host}: {err} (another job "
                "on this machine uses it? choose another MASTER_PORT)"
            ) from None
        sock.listen(1024)  # clients queue here until the host process serves
        self.host, self.port = host, sock.getsockname()[1]
        ready_r, ready_w = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-c", _HOST_SCRIPT, str(sock.fileno()), host, str(self.port),
             str(os.getpid()), str(ready_w)],
            pass_fds=(sock.fileno(), ready_w), stdin=subprocess.DEVNULL, close_fds=True,
        )  # fmt: skip
        sock.close()  # the host holds the socket now
        os.close(ready_w)
        self._wait_ready(ready_r)
        self._owner = os.getpid()
        atexit.register(self.close)

    def _wait_ready(self, ready: int, limit_s: float = 120.0) -> None:
        # a host that failed would leave every rank waiting for the whole timeout: say so now
        try:
            readable, _, _ = select.select([ready], [], [], limit_s)
            ok = bool(readable) and os.read(ready, 1) == b"1"
        finally:
            os.close(ready)
        if not ok:
            self.process.kill()
            raise RuntimeError(
                f"the job's store on {self.host}:{self.port} did not start (its process "
                f"ended with {self.process.wait()}; its error is printed above)"
            )

    def close(self) -> None:
        # (a forked child that exits normally must not stop its launcher's store)
        if os.getpid() == self._owner and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


_host: StoreHost | None = None


def job_store_host(host: str = "127.0.0.1") -> StoreHost:
    """This process's store host (started on first use, kept for the process's life: each
    launch uses its own key prefix in it)."""
    global _host
    if _host is None or _host.host != host or _host.process.poll() is not None:
        _host = StoreHost(host)
    return _host
