"""One communication layer for every plugin: messages, traces, the launch policy."""

from lightning_par.comm.launch import (
    LaunchError,
    LaunchPlan,
    ProcessState,
    choose_start_method,
    is_interactive,
    limit_threads_after_fork,
    one_thread_after_fork,
    plan_launch,
    process_state,
    under_cluster_launcher,
    warn_if_oversubscribed,
)
from lightning_par.comm.p2p import CommError, Communicator, Handle, wait_all
from lightning_par.comm.processes import stop_process_groups
from lightning_par.comm.rendezvous import default_timeout, find_free_port, init_process_group
from lightning_par.comm.run import RankFailed, run_on_ranks
from lightning_par.comm.trace import CommTrace, Event, Message

__all__ = [
    "CommError",
    "CommTrace",
    "Communicator",
    "Event",
    "Handle",
    "LaunchError",
    "LaunchPlan",
    "Message",
    "ProcessState",
    "RankFailed",
    "choose_start_method",
    "default_timeout",
    "find_free_port",
    "init_process_group",
    "is_interactive",
    "limit_threads_after_fork",
    "one_thread_after_fork",
    "plan_launch",
    "process_state",
    "run_on_ranks",
    "stop_process_groups",
    "under_cluster_launcher",
    "wait_all",
    "warn_if_oversubscribed",
]
