"""pytest plugin: the test process behaves as on a machine with a GPU after a backward pass.

There autograd has started its device threads (``pt_autograd_<device>``), torch fails any
backward in a forked child, and :func:`lightning_par.launch.policy.plan_launch` starts
children from a forkserver instead. This plugin makes the test process (not its children)
list such a thread, which is all the policy reads, so a machine without a GPU runs the
suite down that path (``docs/conformance.md``, "On a machine with a GPU")::

    PYTHONPATH=tests/gpu_emulation pytest tests -p fork_unsafe --deselect tests/test_docs_site.py
"""

from __future__ import annotations

import os

_TEST_PROCESS = os.getpid()  # (each pytest-xdist worker imports this plugin itself)


def pytest_configure(config) -> None:
    from lightning_par.launch import policy

    listed = policy._thread_names

    def with_autograd_device_thread() -> list[str] | None:
        names = listed()
        if os.getpid() != _TEST_PROCESS or names is None:
            return names
        return [*names, "pt_autograd_0"]

    policy._thread_names = with_autograd_device_thread
