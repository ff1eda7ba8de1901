"""Every registered strategy × every everyday Lightning feature, against the one table of
expected outcomes (:mod:`lightning_par.features`), which the documentation shows.

One launch per strategy (2 ranks, or its row's ``devices``) runs all its cells
(``run_on_ranks``, the torchrun path); the parameter-server strategies, which start their
own servers, run each cell with a fork launch. Refused cells are run from this process:
they must stop before any rank starts, with a message naming the strategy and the feature."""

from __future__ import annotations

import os
import re
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from _feature_cells import Tiny, cells_on_rank, dataset, rows, run_cell

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par.comm import run_on_ranks
from lightning_par.features import FEATURES, ROWS, expected, markdown_table, row, row_key
from lightning_par.strategies.async_sgd import AsyncSGDStrategy
from lightning_par.strategies.parameter_server import ParameterServerStrategy
from lightning_par.strategies.registry import spec, strategy_specs
from lightning_par.strategies.zero import ZeroStrategy

STRATEGIES = [s.name for s in strategy_specs()]
_reference: dict[str, dict] = {}


def reference(feature: str, tmp_path: Path) -> dict:
    """One process on the whole batch (cached per feature)."""
    if feature not in _reference:
        _reference[feature] = run_cell("auto", 1, feature, str(tmp_path / f"ref-{feature}"), True)
        assert "error" not in _reference[feature], _reference[feature]
    return _reference[feature]


def _launched_by_itself(name: str) -> bool:
    return issubclass(spec(name).load(), (ParameterServerStrategy, AsyncSGDStrategy))


def observe(name: str, tmp_path: Path) -> dict[str, dict]:
    """Every cell of strategy ``name``: refused ones from here, the rest in its ranks."""
    made, world = spec(name), row(name).devices
    out: dict[str, dict] = {}
    running = []
    for feature in FEATURES:
        from_script = expected(name, feature).kind == "refused" or _launched_by_itself(name)
        if from_script or os.environ.get("LIGHTNING_PAR_FEATURES_FROM_SCRIPT") == "1":
            out[feature] = run_cell(made.create, world, feature, str(tmp_path / feature),
                                    getattr(made.load(), "shards_data", True))  # fmt: skip
        else:
            running.append(feature)
    if running:
        out.update(run_on_ranks(cells_on_rank, world, name, running, str(tmp_path), timeout=150)[0])
    return out


#: Mixed precision: a shard's gradient sums over fewer samples in 16 bits (4 of 8 rows)
TOLERANCE = {"bf16_mixed": 1e-2, "fp16_mixed_scaler": 1e-3}


def _close(a: dict, b: dict, atol: float = 2e-5) -> str:
    """'' if the two results' weights and metrics agree, else the largest difference."""
    worst = ("", 0.0)
    for key in b["weights"]:
        if key not in a["weights"]:
            return f"{key} missing"
        d = float(np.abs(a["weights"][key] - b["weights"][key]).max())
        worst = max(worst, (key, d), key=lambda t: t[1])
    for key, value in b["metrics"].items():
        got = a["metrics"].get(key)
        if key == "predictions" and got is None:
            continue  # a launch from here returns none (as Lightning's spawn launchers)
        if key == "predictions":
            value = value[: len(got)]  # rank 0's shard: the first rows of each global batch
        d = float(np.abs(np.asarray(got) - np.asarray(value)).max())
        worst = max(worst, (key, d), key=lambda t: t[1])
    return "" if worst[1] <= atol else f"max |diff| {worst[1]:.2e} in {worst[0]}"


def _trained(result: dict, feature: str) -> str:
    """'' if the weights are finite and moved from the (seeded) initial model."""
    weights, init = result["weights"], Tiny(feature).state_dict()
    if not all(np.isfinite(v).all() for v in weights.values()):
        return "non-finite weights"
    moved = any(not np.allclose(weights[k], init[k].float().numpy()) for k in weights)
    return "" if moved else "the weights never changed"


def judge(name: str, feature: str, got: dict, tmp_path: Path) -> str:
    """'' when the cell behaves as the table says, else what happened instead."""
    want = expected(name, feature)
    if "error" in got:
        if want.kind not in ("refused", "error"):
            return f"failed: {got['error']}"
        if not want.matches(got["error"]):
            return f"message {got['error']!r} lacks {want.message!r}"
        if want.kind == "refused" and name.split("_allreduce")[0] not in got["error"]:
            return f"refusal does not name {name}: {got['error']!r}"
        return ""
    if want.kind in ("refused", "error"):
        return f"ran, but the table says {want}"
    if got["saved"]:
        return f"after fit: {got['saved']}"
    if want.kind == "warns" and not any(want.message in w for w in got["warnings"]):
        return f"no warning containing {want.message!r}"
    if want.kind in ("runs", "warns"):
        return _trained(got, feature)
    if want.kind == "as DDP":
        return _close(got, _lightning_ddp(feature, row(name).data_world, tmp_path))
    atol = TOLERANCE.get(feature, 2e-5)
    diff = _close(got, _comparable(reference(feature, tmp_path), name), atol)
    if want.kind == "differs":
        return "" if diff else "equals one process, but the table says it differs"
    return diff


def _comparable(ref: dict, name: str) -> dict:
    """The one-process result restricted to what rank 0 predicts (its shard)."""
    preds = ref["metrics"].get("predictions")
    if preds is None or not getattr(spec(name).load(), "shards_data", True):
        return ref
    index = rows(0, row(name).data_world, True).numpy()
    return {**ref, "metrics": {**ref["metrics"], "predictions": preds[index]}}


_ddp: dict[tuple[str, int], dict] = {}


def _lightning_ddp(feature: str, world: int, tmp_path: Path) -> dict:
    """Lightning's DDP on as many replicas as the strategy has (cached)."""
    if (feature, world) not in _ddp:
        (res, _) = run_on_ranks(cells_on_rank, world, "lightning_ddp", [feature],
                                str(tmp_path / f"ddp{world}"), timeout=60)  # fmt: skip
        _ddp[(feature, world)] = res[feature]
    return _ddp[(feature, world)]


def describe(got: dict) -> str:
    """'trained', or the error's message (a rank's: the last line of its traceback)."""
    if "error" not in got:
        return "trained"
    lines = [line for line in got["error"].splitlines() if line.strip()]
    return lines[-1] if lines[0].startswith("ProcessRaisedException") else lines[0]


@pytest.mark.parametrize("name", STRATEGIES)
def test_every_feature_is_exact_or_refused_as_the_table_says(name, tmp_path):
    results = observe(name, tmp_path)
    for feature, result in results.items():  # what each cell did (pytest -s shows it)
        print(f"{name} / {feature}: {describe(result)}")
    wrong = {f: why for f in FEATURES if (why := judge(name, f, results[f], tmp_path))}
    assert not wrong, f"{name}: cells that differ from lightning_par.features.ROWS: {wrong}"


#: The table's cells that differ most between zero's stages (stage 3 is zero's row)
ZERO_STAGE_CELLS = ("frozen_layer", "tied_weights", "lbfgs")


def _zero_cells(rank: int, world: int, stages: list[int], tmp: str) -> dict:
    return {(stage, feature): run_cell(partial(ZeroStrategy, stage=stage), world, feature,
                                       os.path.join(tmp, f"{stage}-{feature}"), True)
            for stage in stages for feature in ZERO_STAGE_CELLS}  # fmt: skip


def test_zero_trains_frozen_and_tied_parameters_exactly_and_refuses_lbfgs_by_name(tmp_path):
    """At stages 1 and 2 (the table runs stage 3): a layer frozen throughout and a layer
    applied twice train as one process does (and save a checkpoint that loads there); LBFGS
    stops at setup, named."""
    results = run_on_ranks(_zero_cells, 2, [1, 2], str(tmp_path), timeout=300)[0]
    for (stage, feature), got in results.items():
        what = f"zero stage {stage}, {feature}"
        if feature == "lbfgs":
            assert "zero steps each rank's slice" in got.get("error", ""), (what, got)
            assert "LBFGS is not: its line search" in got["error"], what
            continue
        assert "error" not in got and not got["saved"], (what, got)
        diff = _close(got, reference(feature, tmp_path))
        assert not diff, f"{what}: {diff}"


def test_every_registered_strategy_has_a_row_and_every_row_a_strategy():
    keys = {row_key(name) for name in STRATEGIES}
    assert keys == set(ROWS), (
        f"rows without a strategy or strategies without a row: {keys ^ set(ROWS)}"
    )
    dataset()  # the cells' data is deterministic


def test_the_docs_show_the_table():
    # the documentation's feature page includes the table that docs/conf.py writes from
    # markdown_table() at each build (tests/test_docs_site.py checks the rendered rows)
    docs = Path(__file__).resolve().parents[1] / "docs"
    page = (docs / "guide" / "features.md").read_text()
    assert "```{include} ../_generated/features.md" in page
    assert '"features.md").write_text(markdown_table())' in (docs / "conf.py").read_text()
    assert re.search(r"\| `gpipe` \|", markdown_table())
