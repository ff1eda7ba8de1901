"""Stanford CS336 assignment 2's DDP tests, written anew for every data-parallel plugin and
the parameter servers (after ``stanford-cs336/assignment2-systems``, ``tests/test_ddp.py``
and ``tests/common.py``: gloo, 2 ranks, a toy model with a frozen parameter and one with
tied weights, each rank's weights equal to one process's after a few steps).

Our version: the 4-layer MLP of ``tests/every_launch_script.py`` with a frozen bias and an
unused frozen parameter (``frozen``), or with two layers sharing one weight (``tied``),
5 SGD steps on 2 ranks through Lightning's fork launch, against one process on the two
ranks' batches together. ``async_sgd`` applies each push at once (not one process's
computation): it must train and end cleanly.
"""

from __future__ import annotations

import pytest
from conformance.launchers import (
    check,
    clean_env,
    fork_script_env,
    limit_for,
    python,
    results,
    run_all,
)

from lightning_par.strategies.registry import strategy_specs

DATA_PARALLEL = [s.name for s in strategy_specs() if s.kind in ("data parallel", "reference")]


@pytest.mark.parametrize("model", ["frozen", "tied"])
def test_frozen_and_tied_weights_train_like_one_process(tmp_path, model):
    env = fork_script_env(clean_env({
        "LIGHTNING_PAR_START_METHOD": "fork", "LIGHTNING_PAR_TEST_MODEL": model,
        "LIGHTNING_PAR_TEST_STEPS": "5",
    }))  # fmt: skip
    out = run_all([python(["2", "1", *DATA_PARALLEL], env)], tmp_path, limit_for(DATA_PARALLEL))
    found = results(out)
    check(found, DATA_PARALLEL, [0], "LightningEnvironment")
    assert {r["steps"] for r in found} == {5}
