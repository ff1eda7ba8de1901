"""Ending what a lost member leaves behind at once: its process, and every connection of the
default group, so that no survivor waits for a message that will never come.

A fault-tolerant group (:mod:`.fault_tolerance`) re-forms without a lost member; first
every survivor's waits on the old group must fail, also those on a live peer (which waits
itself, for the lost one), instead of running into the group's long timeout.
"""

from __future__ import annotations

import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist


def end_process(pid: int) -> None:
    """SIGKILL process ``pid`` of this machine (a member found silent), if it still runs."""
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass  # gone already


#: The tag of the receive that breaks a gloo group (no message ever carries it).
_BREAKING_TAG = 0x7FFF_FFF0


def break_default_group() -> None:
    """Close every connection of this process's default group, at once: its own waits and
    its peers' waits on it fail ("connection closed") instead of waiting for the timeout.
    Dropping the group is not enough: a message still waited for keeps it open. NCCL has
    ``abort``; gloo's does nothing, but a receive that times out closes every pair of the
    group (gloo signals the timeout to all of them), which is what is wanted here."""
    world = dist.group.WORLD
    size, rank = world.size(), world.rank()
    if size == 1:
        return
    if str(dist.get_backend()).lower() == "nccl":
        world.abort()
        return
    for peer in range(size):  # (a receive from a peer already lost fails without closing)
        if peer == rank:
            continue
        try:
            world.recv([torch.zeros(1)], peer, _BREAKING_TAG).wait(timedelta(milliseconds=1))
        except RuntimeError as err:
            if "timed out" in str(err).lower() or "timeout" in str(err).lower():
                return  # every connection of the group is closed now
