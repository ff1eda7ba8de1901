"""One communication layer for every plugin: messages (:mod:`~lightning_par.comm.p2p`),
traces (:mod:`~lightning_par.comm.trace`) and gradient buckets
(:mod:`~lightning_par.comm.buckets`).

Starting processes is :mod:`lightning_par.launch`; its public names are also importable
from here, as the course notebooks and users' scripts do
(``from lightning_par.comm import Communicator, run_on_ranks``)."""

from lightning_par import launch as _launch
from lightning_par.comm.p2p import CommError, Communicator, Handle, wait_all
from lightning_par.comm.trace import CommTrace, Event, Message
from lightning_par.launch import *  # noqa: F403 -- launch's public names, re-exported

__all__ = [
    "CommError",
    "CommTrace",
    "Communicator",
    "Event",
    "Handle",
    "Message",
    "wait_all",
    *_launch.__all__,
]
