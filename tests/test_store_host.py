"""The job store of a launch is served by a process of its own, never by the launcher (a rank
forked from a process that serves a store waited seconds, or forever, to reach it), and
that process ends with the launcher."""

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from lightning_par.launch.rendezvous import host_job_store


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(inode)
    return inodes


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def test_the_store_is_served_by_its_own_process_and_keeps_launches_apart():
    first, second = host_job_store(), host_job_store()
    (where, launch1), (where2, launch2) = first.rsplit("/", 1), second.rsplit("/", 1)
    assert where == where2 and launch1 != launch2  # one host, one key prefix per launch
    host, port = where.rsplit(":", 1)
    client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=20))
    client.set(f"{launch1}/k", "one")
    assert client.get(f"{launch1}/k") == b"one"
    from lightning_par.launch.store_host import job_store_host

    listening = _listening_inodes(int(port))
    assert listening, "nothing listens on the store's port"
    assert not listening & _socket_inodes(os.getpid()), "the launcher serves the store itself"
    assert listening & _socket_inodes(job_store_host().process.pid)


def _running(pid: int) -> bool:
    try:  # a zombie (dead, not yet reaped by init) counts as ended
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


_LAUNCHER = """
import sys, time
from lightning_par.launch.rendezvous import host_job_store
from lightning_par.launch.store_host import job_store_host
host_job_store()
print(job_store_host().process.pid, flush=True)
time.sleep(60)
"""


def test_the_store_host_ends_when_its_launcher_is_killed():
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )  # fmt: skip
    try:
        host_pid = int(launcher.stdout.readline())
        assert _running(host_pid)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if not _running(host_pid):
                return
            time.sleep(0.1)
        raise AssertionError(f"store host {host_pid} outlived its killed launcher")
    finally:
        launcher.kill()
