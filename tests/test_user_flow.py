"""The user's whole flow, as users run it (#37): a plain script, ``python flow.py``, with a
network no one here wrote as ``self.model``, Lightning's launcher starting the ranks, then what
Lightning's docs show after training: ``save_checkpoint``, ``validate``, ``test``,
``predict``, ``load_from_checkpoint``, ``fit(ckpt_path=...)``. Every figure is compared with
the same script on one process (tests/userflow/run.py says how).

CI runs a covering grid: every registered strategy and every step, under fork (what a 2-core
machine picks) or popen (what a 16-core workstation picks), each asked for so that every
machine runs it, the networks spread over the rows, plus torchrun, a Jupyter kernel and the
command line (the guide's YAML config, then the options typed). Each run also holds the
launch to what it must be, in every rank that runs the script (``compare``): the cluster
environment Lightning detected, the start method, one epoch's steps, finite evaluation
losses, weights that ``fit`` moved and that ``validate``/``test``/``predict`` left alone.
``make userflow`` runs the full grid and prints its table (tests/userflow/grid.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml

from lightning_par.strategies.registry import plugin_names
from tests.userflow.cli import cli_flow
from tests.userflow.run import Case, baselines, compare, run_flow

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide" / "command-line.md"
#: Every strategy once, networks and start methods spread over the rows.
COVERING = [
    Case("ring_allreduce", "vit", "fork"),
    Case("tree_allreduce", "mlp", "popen"),
    Case("butterfly_allreduce", "transformer", "fork"),
    Case("round_robin_allreduce", "mlp", "fork"),
    Case("all_to_all_allreduce", "vit", "popen"),
    Case("master_worker_allreduce", "mlp", "fork"),
    Case("local_sgd", "transformer", "popen"),
    Case("parameter_server", "vit", "popen"),
    Case("async_sgd", "mlp", "fork"),
    Case("gpipe", "vit", "fork"),
    Case("layerwise", "transformer", "popen"),
    Case("tensor_parallel", "mlp", "popen"),
    Case("hybrid", "mlp", "fork"),
    Case("zero", "vit", "popen"),
    Case("zero", "transformer", "fork"),
    Case("lightning_ddp", "transformer", "fork"),
    Case("gpipe", "mlp", "torchrun"),
    Case("parameter_server", "mlp", "torchrun"),
    Case("gpipe", "transformer", "notebook"),
    Case("ring_allreduce", "mlp", "notebook"),
]


def test_the_covering_grid_holds_every_registered_strategy_and_both_start_methods():
    scripted = {c.strategy for c in COVERING if c.launch in ("fork", "popen")}
    assert scripted == {*plugin_names(), "lightning_ddp"}
    assert {c.launch for c in COVERING} == {"fork", "popen", "torchrun", "notebook"}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[tuple[str, int], dict]:
    """Every one-process run the grid compares with, by (network, data-parallel size)."""
    return baselines(COVERING, tmp_path_factory.mktemp("one"))


@pytest.mark.parametrize("case", COVERING, ids=lambda c: c.name)
def test_user_flow_equals_one_process(case, one_process, tmp_path_factory):
    got, text = run_flow(case, tmp_path_factory.mktemp(case.name))
    problems = compare(case, got, one_process[case.network, case.replicas])
    assert not problems, "\n".join(problems) + "\n--- output ---\n" + text[-4000:]


def test_command_line_flow_from_the_guides_yaml_config_then_typed_equals_one_process(tmp_path):
    """``fit --config=run.yaml`` with the command-line guide's YAML example (gpipe, its
    options as ``class_path``/``init_args``; the tiny settings typed after it win over its
    data and epochs), then ``validate``, ``test``, ``predict`` and the resume with the same
    options typed."""
    example = re.search(r"```yaml\n(.*?)```", GUIDE.read_text(), re.S)[1]
    strategy = yaml.safe_load(example)["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_par.strategies.GPipeStrategy", strategy
    config = tmp_path / "run.yaml"
    config.write_text(example)
    options = [f"--trainer.strategy.{k}={v}" for k, v in strategy["init_args"].items()]
    typed = ["--trainer.devices=2", "--trainer.strategy=GPipeStrategy", *options]
    got = cli_flow(tmp_path / "gpipe", [f"--config={config}"], then=typed)
    summary = "lightning_par summary: strategy=gpipe accelerator=cpu processes=2 "
    assert summary in got["fit_output"], got["fit_output"][-2000:]  # the registered name
    one = ["--trainer.devices=1", "--trainer.strategy=auto"]
    want = cli_flow(tmp_path / "one", one, evaluate=False)
    for key in ("first", "resumed"):  # (optimiser state in both: the resume went on from it)
        (state, step, has_state), (ref, ref_step, _) = got[key], want[key]
        assert has_state and step == ref_step, (key, step, ref_step)
        for name, value in ref.items():
            torch.testing.assert_close(state[name], value, rtol=1e-4, atol=2e-5, msg=name)
