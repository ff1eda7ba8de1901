"""One checkpoint format for every strategy: 2 steps under A (of an epoch of 4), resumed to
step 4 under B, for every pair of strategy kinds (:data:`lightning_par.features.RESUME_KINDS`)
and under Lightning's DDP and in one process, against one process doing the same; through
asynchronous SGD or local SGD (not one process's computation) it only has to train."""

from __future__ import annotations

import numpy as np
from _feature_cells import Tiny, checkpoints_on_rank, resume, resumes_on_rank, write_checkpoint

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par.comm import run_on_ranks
from lightning_par.features import RESUME_KINDS, resume_outcome, row
from lightning_par.strategies.async_sgd import AsyncSGDStrategy
from lightning_par.strategies.parameter_server import ParameterServerStrategy
from lightning_par.strategies.registry import spec

PLUGINS = list(RESUME_KINDS.values())
SOURCES = [*PLUGINS, "one process"]
TARGETS = [*PLUGINS, "lightning_ddp", "one process"]


def _own_launch(name: str) -> bool:
    """Strategies that start their own processes (the parameter servers) run from here."""
    return name != "one process" and issubclass(
        spec(name).load(), (ParameterServerStrategy, AsyncSGDStrategy)
    )


def _devices(name: str) -> int:
    return 1 if name == "one process" else row(name).devices


def _max_diff(a: dict, b: dict) -> float:
    return max(float(np.abs(a[k] - b[k]).max()) for k in b)


def test_a_checkpoint_resumes_under_every_other_strategy(tmp_path):
    tmp = str(tmp_path)
    in_ranks = [s for s in PLUGINS if not _own_launch(s)]
    for world in sorted({_devices(s) for s in in_ranks}):  # one launch per world size
        names = [s for s in in_ranks if _devices(s) == world]
        run_on_ranks(checkpoints_on_rank, world, names, tmp, timeout=120)
    for source in SOURCES:
        if source not in in_ranks:
            write_checkpoint(source, str(tmp_path / source))
    expected = resume("one process", str(tmp_path / "one process" / "mid.ckpt"))["weights"]

    pairs = [(s, t) for s in SOURCES for t in TARGETS if t != "one process" and not _own_launch(t)]
    got = {}
    for world in sorted({_devices(t) for _, t in pairs}):
        mine = [(s, t) for s, t in pairs if _devices(t) == world]
        got.update(run_on_ranks(resumes_on_rank, world, mine, tmp, timeout=150)[0])
    for source in SOURCES:
        for target in TARGETS:
            if target == "one process" or _own_launch(target):
                got[(source, target)] = resume(target, str(tmp_path / source / "mid.ckpt"))

    init = {k: v.float().numpy() for k, v in Tiny("resume_mid_epoch").state_dict().items()}
    table, wrong = [], []
    for (source, target), result in sorted(got.items()):
        want = resume_outcome(source, target)
        if "error" in result:
            seen = result["error"].splitlines()[0][:120]
        elif not all(np.isfinite(v).all() for v in result["weights"].values()):
            seen = "non-finite weights"
        elif want.kind == "exact":
            diff = _max_diff(result["weights"], expected)
            seen = "exact" if diff < 2e-5 else f"differs by {diff:.1e}"
        else:
            seen = "runs" if _max_diff(result["weights"], init) > 0 else "did not train"
        table.append(f"{source} -> {target}: {seen}")
        if seen != want.kind:
            wrong.append(table[-1])
    print("\n".join(table))
    assert not wrong, "resumes that differ from lightning_par.features.resume_outcome:\n" + (
        "\n".join(wrong)
    )
