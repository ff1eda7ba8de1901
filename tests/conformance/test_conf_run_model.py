"""Lightning's strategy test pipeline for every registered strategy.

Written anew after reading ``run_model_test`` (and ``run_model_test_without_loggers``) in
Lightning-AI/pytorch-lightning, ``tests/tests_pytorch/helpers/pipelines.py``: after ``fit``
the parameters have moved (Lightning asks a norm change ratio >= 0.03); the checkpoint
reloads to the weights fit left; ``validate`` and ``test`` (our addition from Lightning's
``test_evaluation_loop``-style checks) leave them unchanged. Beyond the original, which only
restores the checkpoint: one epoch (4 steps, SGD with momentum) saved and resumed to 8 gives
the weights of 8 straight, and the same resume from a copy of the checkpoint with the
optimiser state removed does not (so the momentum really travels through every strategy's
checkpoint).

One launch per world size runs every strategy of that size in turn (the ranks start once);
the parameter servers start their own processes, so they run from the test process.
Where :mod:`lightning_par.features` says a resume only "runs" (``async_sgd``: workers push
in whatever order they finish, and rank 0's checkpoint at its epoch end does not hold the
other worker's last pushes; ``local_sgd``: each rank's momentum is its own and the checkpoint
holds rank 0's), the checkpoint must load and the resume train on. A strategy the table
marks as unable to resume must refuse, naming itself.
"""

from __future__ import annotations

from conformance.run_model import run_model, run_models_on_rank

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par.comm import run_on_ranks
from lightning_par.features import row
from lightning_par.strategies.async_sgd import AsyncSGDStrategy
from lightning_par.strategies.parameter_server import ParameterServerStrategy
from lightning_par.strategies.registry import strategy_specs

ALL = [s.name for s in strategy_specs()]
OWN_LAUNCH = [
    s.name
    for s in strategy_specs()
    if issubclass(s.load(), (ParameterServerStrategy, AsyncSGDStrategy))
]
MIN_CHANGE = 0.03  # Lightning's min_change_ratio
ATOL = 2e-5


def _at_most(gap: float | None, bound: float) -> bool:
    """``gap <= bound``; ``None`` (rank 0 did not hold the full model) never is."""
    return gap is not None and gap <= bound


def _outcomes(tmp_path) -> dict[str, dict]:
    tmp = str(tmp_path)
    in_ranks = [n for n in ALL if n not in OWN_LAUNCH]
    found: dict[str, dict] = {}
    for world in sorted({row(n).devices for n in in_ranks}):
        names = [n for n in in_ranks if row(n).devices == world]
        ranks = run_on_ranks(run_models_on_rank, world, names, tmp, timeout=150)
        for name in names:
            found[name] = ranks[0][name]
            # a rank > 0 that holds the whole model (data parallel) must resume like rank 0
            found[name]["other_ranks_resume_gap"] = [r[name].get("resume_gap") for r in ranks[1:]]
    for name in OWN_LAUNCH:
        found[name] = run_model(name, str(tmp_path / name))
    return found


def test_every_strategy_through_lightnings_run_model_pipeline(tmp_path):
    found = _outcomes(tmp_path)
    assert set(found) == set(ALL)
    wrong = []
    for name, got in sorted(found.items()):
        print(name, got)
        resume = row(name).outcome("resume_mid_epoch")
        if resume.kind == "refused":
            if name not in got.get("error", ""):
                wrong.append(f"{name}: refuses to resume without naming itself: {got}")
            continue
        if "error" in got:
            wrong.append(f"{name}: {got['error']}")
            continue
        checks = {
            "fit moved the parameters": got["moved"] >= MIN_CHANGE,
            "4 steps saved": got["step"] == 4,
            "validate/test left the weights": got["eval_changed"] == 0.0,
            "finite weights": got["finite"],
        }
        if resume.kind == "runs":  # (why: the feature table's message for the cell)
            checks["the resume trained on"] = not _at_most(got["resume_moved"], 0.0)
        else:
            checks["the checkpoint holds what fit left"] = _at_most(got["checkpoint"], ATOL)
            checks["resumed == straight"] = _at_most(got["resume_gap"], ATOL)
            checks["resumed == straight on every whole replica"] = all(
                gap is None or gap <= ATOL for gap in got.get("other_ranks_resume_gap", [])
            )
            checks["without the optimiser state it differs"] = not _at_most(got["cold_gap"], 0.01)
        wrong += [f"{name}: {what} ({got})" for what, ok in checks.items() if not ok]
    assert not wrong, "\n".join(wrong)
