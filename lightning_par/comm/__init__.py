"""One communication layer for every plugin: messages (:mod:`~lightning_par.comm.p2p`),
traces (:mod:`~lightning_par.comm.trace`) and gradient buckets
(:mod:`~lightning_par.comm.buckets`).

Starting processes is :mod:`lightning_par.launch`; its public names are also importable
from here, as the course notebooks and users' scripts do
(``from lightning_par.comm import Communicator, run_on_ranks``)."""

from lightning_par.comm.p2p import CommError, Communicator, Handle, wait_all
from lightning_par.comm.trace import CommTrace, Event, Message
from lightning_par.launch.policy import (
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
from lightning_par.launch.processes import stop_process_groups
from lightning_par.launch.rendezvous import default_timeout, find_free_port, init_process_group
from lightning_par.launch.run import RankFailed, run_on_ranks

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
