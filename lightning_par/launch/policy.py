"""The launch policy: how every multi-process entry point of this project starts its ranks.

One function, :func:`plan_launch`, decides from facts checked at launch time
(:func:`process_state`), and every entry point follows it: the strategies' launchers,
:func:`~lightning_par.comm.run_on_ranks`, the benchmarks, the check, and the Lightning DDP
reference the tests and notebooks compare against. Why these facts:

* **Ranks that already exist** (torchrun, SLURM, ``run_on_ranks``): start nothing.
* **CUDA initialised in this process**: a forked child cannot use CUDA at all (even
  Lightning's ``isolate_rng`` touches it), so fork is out.
* **Autograd device threads started**: on a machine with a GPU, the first ``backward``
  starts one autograd thread per device, and a forked child's own ``backward`` then raises
  "Unable to handle autograd's threading in combination with fork-based multiprocessing".
  Fork is out. (torch names those threads ``pt_autograd_<device>``.)
* **An OpenMP pool started**: a forked child hangs in its first multi-threaded OpenMP
  region (GNU libgomp is not fork-safe). Whether the pool runs cannot be told apart from
  torch's own threads reliably, so every forked rank computes on one intra-op thread;
  scripts therefore fork only where each rank gets one core anyway.
* **A notebook**: only fork works (a cell's functions cannot be imported by a new
  interpreter), so when fork is out the launch stops *before* any process starts with
  :class:`LaunchError`, saying what was initialised and how to fix it.
* **Tests** (pytest): fork when safe, else ``forkserver`` (a clean server process forks
  the ranks; test functions and modules are importable, so it works).
* **Scripts**: ``fork`` on a CPU whose cores give each rank at most one thread anyway (1 s
  to start instead of 8-15 s for a fresh interpreter on a 2-core machine) and nothing
  above made fork unsafe; otherwise Lightning's ``popen``, which re-runs the script, so
  every rank is a fresh process with all the threads it is given.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass

START_METHODS = ("fork", "popen", "spawn", "forkserver")
#: Modules a forkserver imports once, so that each rank it forks starts in milliseconds.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "lightning.pytorch"]


class LaunchError(RuntimeError):
    """Ranks cannot be started safely from this process; the message says how to fix it."""


@dataclass(frozen=True)
class ProcessState:
    """What this process has initialised that decides how ranks may be started."""

    cuda_initialized: bool
    autograd_threads: bool
    interactive: bool
    under_pytest: bool
    external_ranks: bool
    cores: int

    @property
    def fork_hazards(self) -> list[str]:
        """Why a forked child could not work, in words (empty: fork is safe)."""
        hazards = []
        if self.cuda_initialized:
            hazards.append("CUDA is initialised in this process (a forked child cannot use it)")
        if self.autograd_threads:
            hazards.append(
                "autograd has started its GPU device threads in this process (a backward pass "
                "ran here); a forked child's backward would fail"
            )
        return hazards


def is_interactive() -> bool:
    """True inside Jupyter/IPython or the plain interactive interpreter."""
    main = sys.modules.get("__main__")
    return (
        hasattr(sys, "ps1") or bool(getattr(main, "__IPYTHON__", 0)) or ("ipykernel" in sys.modules)
    )


def under_cluster_launcher() -> bool:
    """True when torchrun or SLURM's ``srun`` already started one process per rank.

    An interactive SLURM allocation (job name ``bash`` or ``interactive``, as Lightning's
    ``SLURMEnvironment`` reads it) has ``SLURM_NTASKS`` but no ranks: Lightning starts
    them, as on any machine."""
    env = os.environ
    torchrun = "LOCAL_RANK" in env and "WORLD_SIZE" in env
    srun = "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive")
    return torchrun or srun


def _thread_names() -> list[str] | None:
    """Names of this process's OS threads (Linux ``/proc``), ``None`` where unknown."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    names = []
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            continue  # the thread ended meanwhile
    return names


def autograd_threads_started() -> bool:
    names = _thread_names()
    return names is not None and any(n.startswith("pt_autograd_") for n in names)


def cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def process_state() -> ProcessState:
    """The facts about this process that :func:`plan_launch` decides from."""
    return ProcessState(
        cuda_initialized=cuda_initialized(),
        autograd_threads=autograd_threads_started(),
        # (pytest's nbval plugin imports ipykernel: the test process is no notebook)
        interactive=is_interactive() and "pytest" not in sys.modules,
        under_pytest="pytest" in sys.modules,
        external_ranks=under_cluster_launcher(),
        cores=os.cpu_count() or 1,
    )


@dataclass(frozen=True)
class LaunchPlan:
    """How to start the ranks: ``method`` (``"external"``: they exist already) and, for
    forked ranks, the intra-op threads each one computes on."""

    method: str
    threads_per_rank: int
    reason: str


def plan_launch(
    accelerator: str = "cpu",
    num_processes: int = 1,
    *,
    requested: str | None = None,
    state: ProcessState | None = None,
    can_exec: bool = True,
) -> LaunchPlan:
    """Decide how to start ``num_processes`` ranks (see the module docstring).

    Args:
        accelerator: ``"cpu"``, ``"cuda"``, ...: where the ranks compute.
        requested: a start method the user asked for (or ``LIGHTNING_PAR_START_METHOD``);
            honoured, but ``fork`` still gets the one-thread rule and the hazard check.
        state: the facts (default: :func:`process_state` now).
        can_exec: ``False`` for entry points whose rank function cannot be re-created in a
            fresh interpreter by re-running a script (``run_on_ranks``, the parameter
            servers): they choose between ``fork`` and ``forkserver`` only, and start
            their processes whoever started this one (torchrun, SLURM, ``popen``).
    """
    state = state or process_state()
    num_processes = max(1, num_processes)
    cores_per_rank = max(1, state.cores // num_processes)
    fork_threads = 1  # see the module docstring: a forked rank never uses OpenMP threads
    if state.external_ranks and can_exec:
        return LaunchPlan("external", 0, "the ranks were started by an external launcher")
    requested = requested or os.environ.get("LIGHTNING_PAR_START_METHOD") or None
    if requested == "popen" and not can_exec:
        requested = None  # (asked of the Lightning launch; a function cannot be re-run so)
    if requested is not None:
        if requested not in START_METHODS:
            raise ValueError(f"start method {requested!r} is not one of {START_METHODS}")
        if requested == "fork" and state.fork_hazards:
            raise LaunchError(_fork_refused(state, asked=True))
        return LaunchPlan(requested, fork_threads if requested == "fork" else 0, "requested")
    hazards = state.fork_hazards
    if state.interactive:
        if hazards:
            raise LaunchError(_fork_refused(state, asked=False))
        return LaunchPlan("fork", fork_threads, "a notebook can only fork")
    if hazards:
        if state.under_pytest or not can_exec:
            return LaunchPlan("forkserver", 0, "fork is unsafe here: " + "; ".join(hazards))
        return LaunchPlan("popen", 0, "fork is unsafe here: " + "; ".join(hazards))
    if state.under_pytest or not can_exec:
        return LaunchPlan("fork", fork_threads, "tests and run_on_ranks fork when it is safe")
    if accelerator == "cpu" and cores_per_rank <= 1:
        return LaunchPlan("fork", 1, "one core per rank: fork starts fastest and loses nothing")
    return LaunchPlan("popen", 0, "each rank gets several cores or a GPU: fresh processes")


def _fork_refused(state: ProcessState, *, asked: bool) -> str:
    where = "start_method='fork' was requested" if asked else "in a notebook only fork works"
    return (
        f"cannot start the ranks: {where}, but " + " and ".join(state.fork_hazards) + ". "
        "Fix: restart the kernel (or interpreter) and run the multi-process cell before "
        "anything touches CUDA or runs a backward pass on a machine with a GPU; or run the "
        "training as a script (python train.py), where fresh processes are started instead."
    )


def choose_start_method(accelerator: str = "cpu", num_processes: int | None = None) -> str:
    """The start method :func:`plan_launch` picks for a Lightning launch now."""
    return plan_launch(accelerator, num_processes or 1).method


def limit_threads_after_fork(threads: int = 1) -> None:
    """Call first thing in a forked rank: compute on ``threads`` intra-op threads (the
    plan's ``threads_per_rank``).

    A forked child hangs in its first multi-threaded OpenMP region if its parent had
    already started OpenMP threads (GNU libgomp is not fork-safe; reproduced with torch
    2.14 for every thread count above one), so :func:`plan_launch` gives forked ranks one
    thread. ``OMP_NUM_THREADS`` is set too,
    so that Lightning's launcher keeps the choice.
    """
    import torch

    threads = max(1, threads)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)


def one_thread_after_fork() -> None:
    """:func:`limit_threads_after_fork` with one thread (always safe after a fork)."""
    limit_threads_after_fork(1)


def warn_if_oversubscribed(accelerator: str, num_processes: int, devices: int | None = None) -> str:
    """Warn (and return the text) when more ranks than cores, or than GPUs, are asked for."""
    cores = os.cpu_count() or 1
    message = ""
    if accelerator == "cpu" and num_processes > cores:
        message = (
            f"{num_processes} processes on {cores} CPU cores: they take turns on the cores, so "
            f"each step takes about {num_processes / cores:.1f}x as long as with {cores} "
            f"processes, and memory grows with every process. Use devices <= {cores}."
        )
    elif devices is not None and accelerator != "cpu" and num_processes > devices:
        message = (
            f"{num_processes} processes on {devices} {accelerator} device(s): ranks would share "
            f"a device (NCCL refuses that). Use devices <= {devices}."
        )
    if message:
        warnings.warn(message, UserWarning, stacklevel=2)
    return message
