"""The user's whole flow, as users run it (#37): a plain script, ``python flow.py``, with a
network no one here wrote as ``self.model``, Lightning choosing the launcher, then what
Lightning's docs show after training: ``save_checkpoint``, ``validate``, ``test``,
``predict``, ``load_from_checkpoint``, ``fit(ckpt_path=...)``. Every figure is compared with
the same script on one process (tests/userflow/run.py says how).

CI runs a covering grid: every registered strategy and every step, under fork (what a 2-core
machine picks) and popen (what a 16-core workstation picks), the networks spread over the
rows, plus torchrun, a Jupyter kernel and the command line (options typed, and a YAML
config). ``make userflow`` runs the full grid and prints its table (tests/userflow/grid.py).
"""

from __future__ import annotations

import pytest
import torch

from lightning_par.strategies.registry import plugin_names
from tests.userflow.cli import cli_flow
from tests.userflow.run import Case, baseline, compare, run_flow

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


@pytest.mark.parametrize("case", COVERING, ids=lambda c: c.name)
def test_user_flow_equals_one_process(case, tmp_path_factory):
    want = baseline(case.network, case.replicas, str(tmp_path_factory.getbasetemp()))
    got, text = run_flow(case, tmp_path_factory.mktemp(case.name))
    problems = compare(case, got, want)
    assert not problems, "\n".join(problems) + "\n--- output ---\n" + text[-4000:]


def test_command_line_flow_with_typed_options_equals_one_process(tmp_path):
    typed = ["--trainer.devices=2", "--trainer.strategy=GPipeStrategy",
             "--trainer.strategy.chunks=2", "--trainer.strategy.schedule=1f1b"]  # fmt: skip
    got = cli_flow(tmp_path / "gpipe", typed)
    one = ["--trainer.devices=1", "--trainer.strategy=auto"]
    want = cli_flow(tmp_path / "one", one, evaluate=False)
    for key in ("first", "resumed"):
        (state, step, has_state), (ref, ref_step, _) = got[key], want[key]
        assert has_state and step == ref_step, (key, step, ref_step)
        for name, value in ref.items():
            torch.testing.assert_close(state[name], value, rtol=1e-4, atol=2e-5, msg=name)


def test_command_line_flow_from_a_yaml_config(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        "trainer:\n  devices: 2\n  strategy:\n"
        "    class_path: lightning_par.strategies.ParameterServerStrategy\n"
        "    init_args:\n      num_servers: 2\n"
    )
    got = cli_flow(tmp_path / "ps", [f"--config={config}"])
    (_, step, has_state), (_, resumed_step, resumed_state) = got["first"], got["resumed"]
    assert has_state and resumed_state  # the servers' optimiser state is in both files
    assert resumed_step == 2 * step > 0  # the resumed fit went on from the first one
