"""The user's whole flow, as users run it (#37): a plain script, ``python flow.py``, with a
network no one here wrote as ``self.model``, Lightning choosing the launcher, then what
Lightning's docs show after training: ``save_checkpoint``, ``validate``, ``test``,
``predict``, ``load_from_checkpoint``, ``fit(ckpt_path=...)``. Every figure is compared with
the same script on one process (tests/userflow/run.py says how).

CI runs a covering grid: every registered strategy and every step, under fork (what a 2-core
machine picks) or popen (what a 16-core workstation picks), each asked for so that every
machine runs it, the networks spread over the rows, plus torchrun, a Jupyter kernel and the
command line (options typed, then read from a YAML config). Each run also holds the launch
to what it must be, in every rank that runs the script (``compare``): the cluster
environment Lightning detected, the start method, one epoch's steps, finite evaluation
losses, weights that ``fit`` moved and that ``validate``/``test``/``predict`` left alone.
``make userflow`` runs the full grid and prints its table (tests/userflow/grid.py).
"""

from __future__ import annotations

import pytest
import torch

from lightning_par.strategies.registry import plugin_names
from tests.userflow.cli import cli_flow
from tests.userflow.run import Case, baselines, compare, run_flow

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


def test_command_line_flow_typed_then_from_a_yaml_config_equals_one_process(tmp_path):
    """``fit`` with the options typed, then ``validate``, ``test``, ``predict`` and the resume
    with the same options read from a YAML config (the ``class_path``/``init_args`` form)."""
    config = tmp_path / "run.yaml"
    config.write_text(
        "trainer:\n  devices: 2\n  strategy:\n"
        "    class_path: lightning_par.strategies.GPipeStrategy\n"
        "    init_args:\n      chunks: 2\n      schedule: 1f1b\n"
    )
    typed = ["--trainer.devices=2", "--trainer.strategy=GPipeStrategy",
             "--trainer.strategy.chunks=2", "--trainer.strategy.schedule=1f1b"]  # fmt: skip
    got = cli_flow(tmp_path / "gpipe", typed, then=[f"--config={config}"])
    one = ["--trainer.devices=1", "--trainer.strategy=auto"]
    want = cli_flow(tmp_path / "one", one, evaluate=False)
    for key in ("first", "resumed"):  # (optimiser state in both: the resume went on from it)
        (state, step, has_state), (ref, ref_step, _) = got[key], want[key]
        assert has_state and step == ref_step, (key, step, ref_step)
        for name, value in ref.items():
            torch.testing.assert_close(state[name], value, rtol=1e-4, atol=2e-5, msg=name)
