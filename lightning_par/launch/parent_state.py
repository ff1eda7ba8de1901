"""What a forked child inherits from its parent and a forkserver child does not.

A forkserver is a process started once, the first time one is needed; every child it forks
starts from the server's state, not from the process that asked for it. Where fork is unsafe
(CUDA initialised, autograd's device threads started: a GPU machine after a backward pass)
the launches fall back to a forkserver (:func:`~lightning_par.launch.policy.plan_launch`),
and the children must still start as forked ones would. :class:`ParentState` is pickled with
each child's arguments and, at that moment, reads in the parent:

* the environment: the server keeps the one it started with, so a ``PL_GLOBAL_SEED`` set
  by a later ``seed_everything`` (Lightning reseeds every rank from it) or a timeout set
  since would be missing or stale;
* the random states of torch (CPU), numpy and ``random``, and the deterministic-algorithm
  flags (Lightning carries these for ``spawn`` only: ``_GlobalStateSnapshot``);
* standard output and error: the server writes where the parent's were when it started
  (for a test, an earlier test's capture), the child where they are now.

:meth:`ParentState.restore`, first thing in the child, applies them; in the process that
built it (never pickled) it does nothing.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from lightning_par import _compat

STDIO = (1, 2)


class ParentState:
    """The parent's state, read when this object is pickled for a child."""

    def __getstate__(self) -> dict[str, Any]:
        from multiprocessing import context, reduction

        import torch

        spawning = context.get_spawning_popen() is not None  # pickled to start a child
        # tensors as bytes: a pickled tensor goes through shared memory, freed with this dict
        rng = {k: bytes(v.numpy()) if isinstance(v, torch.Tensor) else v
               for k, v in _compat.rng_states().items()}  # fmt: skip
        flags = (torch.are_deterministic_algorithms_enabled(),
                 torch.is_deterministic_algorithms_warn_only_enabled())  # fmt: skip
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        stdio = [reduction.DupFd(fd) for fd in STDIO] if spawning else []
        return {"environ": dict(os.environ), "rng": rng, "deterministic": flags,
                "stdio": stdio}  # fmt: skip

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def restore(self) -> None:
        """In the child: the parent's environment, random states, flags and output."""
        if "environ" not in self.__dict__:
            return  # the parent's own object: nothing to restore
        import torch

        for key in set(os.environ) - set(self.environ):
            del os.environ[key]
        os.environ.update(self.environ)
        _compat.set_rng_states({
            k: torch.frombuffer(bytearray(v), dtype=torch.uint8) if isinstance(v, bytes) else v
            for k, v in self.rng.items()
        })  # fmt: skip
        torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        for target, dup in zip(STDIO, self.stdio):
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            fd = dup.detach()
            os.dup2(fd, target)
            os.close(fd)
