"""Process-group set-up: free ports on loopback and a timeout on every group."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist

#: Seconds before a collective or receive gives up on a silent peer. Override with the
#: environment variable ``LIGHTNING_PAR_TIMEOUT``.
DEFAULT_TIMEOUT_S = 60.0


def default_timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get("LIGHTNING_PAR_TIMEOUT", DEFAULT_TIMEOUT_S)))


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free on ``host`` (loopback by default, never a fixed number)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


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
        timeout=timeout or default_timeout(),
    )
