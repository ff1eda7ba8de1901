"""Starting ranks: torch's process context (a fork launch that names a lost rank),
Lightning's launchers and its observer of a popen launch's scripts, the memory and random
state a forkserver rank starts from, and the default process group's store and backend."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning_par._compat.lookup import moved, private, private_class, require


@contextmanager
def patched_start_processes(wrap: Callable[[Any], Any]) -> Iterator[None]:
    """While inside, every ``torch.multiprocessing.start_processes`` context (Lightning's
    fork launch calls it through the module) is passed to ``wrap`` before it is returned.
    The context's ``processes``, ``sentinels`` and ``error_files`` must exist."""
    import torch.multiprocessing as tmp

    needed_by = "a fork launch that names a lost rank (async_sgd: goes on without a worker)"
    require(tmp, "start_processes", "torch.multiprocessing.start_processes", needed_by)
    for attr in ("processes", "sentinels", "error_files", "join"):
        _require_context_attr(attr, needed_by)
    original = tmp.start_processes

    def start_processes(*args: Any, **kwargs: Any) -> Any:
        return wrap(original(*args, **kwargs))

    tmp.start_processes = start_processes
    try:
        yield
    finally:
        tmp.start_processes = original


def _require_context_attr(attr: str, needed_by: str) -> None:
    """:class:`CompatError` unless torch's ``ProcessContext`` sets ``attr``."""
    from torch.multiprocessing.spawn import ProcessContext

    try:  # instance attributes: set in __init__
        source = inspect.getsource(ProcessContext.__init__)
    except (OSError, TypeError):  # no source shipped: cannot tell, trust the version
        return
    if not hasattr(ProcessContext, attr) and f"self.{attr} =" not in source:
        raise moved(f"torch.multiprocessing.ProcessContext.{attr}", needed_by)


_LAUNCHERS = "lightning.pytorch.strategies.launchers"


@contextmanager
def replaced_process_observer(observe: Callable[[list], None]) -> Iterator[None]:
    """While inside, a ``popen`` launch hands its child processes to ``observe`` instead of
    starting Lightning's observer of them (which SIGKILLs the launching process 5 s after a
    child fails, before it can say which rank was lost)."""
    name, needed_by = f"{_LAUNCHERS}.subprocess_script", "naming a lost popen rank"
    try:
        launchers = importlib.import_module(name)
    except ImportError as err:
        raise moved(name, needed_by) from err
    require(launchers, "_launch_process_observer", f"{name}._launch_process_observer", needed_by)
    original = launchers._launch_process_observer
    launchers._launch_process_observer = observe
    try:
        yield
    finally:
        launchers._launch_process_observer = original


#: Lightning's launcher of a script's other ranks (``popen``), also used for ranks that
#: already exist (torchrun, SLURM).
SubprocessScriptLauncher = private_class(
    f"{_LAUNCHERS}.subprocess_script", "_SubprocessScriptLauncher", "popen and torchrun launches"
)


def script_command(local_rank: int) -> tuple[list[str], str | None]:
    """The command (and working folder, under Hydra) that Lightning's ``popen`` launch runs
    a script's rank ``local_rank`` with: this script again, with its arguments."""
    module, needed_by = "lightning.fabric.strategies.launchers.subprocess_script", "popen"
    if private(module, "_HYDRA_AVAILABLE", needed_by):
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            command, cwd = private(module, "_hydra_subprocess_cmd", needed_by)(local_rank)
            return list(command), cwd
    return list(private(module, "_basic_subprocess_cmd", needed_by)()), None


#: Lightning's fork/spawn launcher (its ``_wrapping_function`` is overridden) and the type
#: of what it returns from rank 0.
MultiProcessingLauncher = private_class(
    f"{_LAUNCHERS}.multiprocessing", "_MultiProcessingLauncher", "fork and forkserver launches"
)


WorkerOutput = private_class(f"{_LAUNCHERS}.multiprocessing", "_WorkerOutput", "fork launches")


def disable_module_memory_sharing(data: Any) -> Any:
    """Copies of the modules and tensors in ``data`` out of shared memory (what Lightning
    does for ``spawn`` ranks; a forkserver rank needs it too, or every rank steps the
    same parameters)."""
    unshare = private(
        "lightning.fabric.strategies.launchers.multiprocessing",
        "_disable_module_memory_sharing", "forkserver ranks owning their weights",
    )  # fmt: skip
    return unshare(data)


def rng_states() -> dict:
    """The CPU random states of torch, numpy and ``random`` (Lightning's collector, without
    CUDA's: reading those would initialise CUDA in the main process)."""
    collect = private("lightning.fabric.utilities.seed", "_collect_rng_states",
                      "forkserver ranks starting from the main process's random state")  # fmt: skip
    return collect(include_cuda=False)


def set_rng_states(states: dict) -> None:
    """Restore what :func:`rng_states` read."""
    private("lightning.fabric.utilities.seed", "_set_rng_states",
            "forkserver ranks starting from the main process's random state")(states)  # fmt: skip


def default_store() -> Any:
    """The default process group's key-value store (torch has no public accessor).

    Raises :class:`CompatError` if the accessor moved; whatever torch raises (no group)
    otherwise."""
    get = private(
        "torch.distributed.distributed_c10d", "_get_default_store",
        "a parameter server's diagnosis reaching the workers",
    )  # fmt: skip
    return get()


def default_process_group_backend(device: Any) -> str:
    """Lightning's default backend for a device (``nccl`` for CUDA, else ``gloo``)."""
    get = private(
        "lightning.fabric.utilities.distributed",
        "_get_default_process_group_backend_for_device", "choosing a process group backend",
    )  # fmt: skip
    return get(device)
