"""What a benchmark ran on, said the same way by every benchmark.

A figure means little without its machine: the ratios to torch's peers moved between torch
releases (torch 2.11's interleaved schedules failed where 2.14's ran), and on a shared
machine the load from other processes stretches every wall clock. Each benchmark's output
begins with one line (text) or carries one ``"environment"`` object (``--json``): torch,
Lightning and Python versions, the machine, its cores, the GPUs torch sees, and the
1-minute load average when the run started and when it ended (the start tells how busy the
machine was before the run; the end includes the run's own processes).
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import lightning
import torch


def _load_1m() -> float:
    return round(os.getloadavg()[0], 2)


@dataclass(frozen=True)
class RunEnvironment:
    """The versions and the machine, read when a benchmark starts (:meth:`now`)."""

    torch: str
    lightning: str
    python: str
    machine: str
    cores: int
    gpus: int
    load_1m_start: float

    @classmethod
    def now(cls) -> RunEnvironment:
        return cls(
            torch=torch.__version__,
            lightning=lightning.__version__,
            python=platform.python_version(),
            machine=f"{platform.system()} {platform.machine()}",
            cores=os.cpu_count() or 1,
            gpus=torch.cuda.device_count(),  # (NVML-based: does not initialise CUDA)
            load_1m_start=_load_1m(),
        )

    def finished(self) -> dict[str, Any]:
        """The environment as JSON, with the load at the end of the run added."""
        return {**asdict(self), "load_1m_end": _load_1m()}


def environment_line(env: dict[str, Any]) -> str:
    """The one line a text report starts with."""
    gpus = f", {env['gpus']} GPU{'s' if env['gpus'] != 1 else ''}" if env["gpus"] else ""
    return (
        f"ran on torch {env['torch']}, Lightning {env['lightning']}, Python {env['python']}, "
        f"{env['machine']}, {env['cores']} cores{gpus}, load (1 min) {env['load_1m_start']:.2f} "
        f"at the start, {env['load_1m_end']:.2f} at the end"
    )


def print_result(
    result: dict[str, Any],
    report: Callable[[dict[str, Any]], str],
    as_json: bool,
    started: RunEnvironment,
    indent: int | None = None,
) -> None:
    """Print ``result`` as one JSON document with its ``"environment"``, or the environment
    line and ``report(result)``."""
    env = started.finished()
    if as_json:
        print(json.dumps({"environment": env, **result}, indent=indent))
    else:
        print(environment_line(env))
        print(report(result))
