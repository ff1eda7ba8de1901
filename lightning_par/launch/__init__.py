"""Process management, apart from messaging (:mod:`lightning_par.comm`): how ranks start
(:mod:`~lightning_par.launch.policy`: the start method and the launch plan), the process
trees they run in (:mod:`~lightning_par.launch.processes`), the job's store
(:mod:`~lightning_par.launch.store_host`) and the rendezvous in it
(:mod:`~lightning_par.launch.rendezvous`), who is still alive
(:mod:`~lightning_par.launch.liveness` over :mod:`~lightning_par.launch.heartbeat`,
:mod:`~lightning_par.launch.process_id`), naming a
rank the job lost
(:mod:`~lightning_par.launch.lost`), injecting such a loss (:mod:`~lightning_par.launch.faults`)
and running a function on a few local ranks (:mod:`~lightning_par.launch.run`)."""

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
    "LaunchError",
    "LaunchPlan",
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
    "warn_if_oversubscribed",
]
