"""One communication layer for every plugin: messages, traces, launching."""

from lightning_par.comm.launch import (
    RankFailed,
    choose_start_method,
    is_interactive,
    one_thread_after_fork,
    run_on_ranks,
    under_cluster_launcher,
)
from lightning_par.comm.p2p import CommError, Communicator, Handle, wait_all
from lightning_par.comm.rendezvous import default_timeout, find_free_port, init_process_group
from lightning_par.comm.trace import CommTrace, Event, Message

__all__ = [
    "CommError",
    "CommTrace",
    "Communicator",
    "Event",
    "Handle",
    "Message",
    "RankFailed",
    "choose_start_method",
    "default_timeout",
    "find_free_port",
    "init_process_group",
    "is_interactive",
    "one_thread_after_fork",
    "run_on_ranks",
    "under_cluster_launcher",
    "wait_all",
]
