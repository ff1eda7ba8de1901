"""The user's whole flow, as users run it (#37): a plain script, ``python flow.py``, with a
network no one here wrote as ``self.model``, Lightning choosing the launcher, then what
Lightning's docs show after training: ``save_checkpoint``, ``validate``, ``test``,
``predict``, ``load_from_checkpoint``, ``fit(ckpt_path=...)``. Every figure is compared with
the same script on one process (tests/userflow/run.py says how).

CI runs a covering grid: every registered strategy and every step, under fork (what a 2-core
machine picks) and popen (what a 16-core workstation picks), the networks spread over the
rows, plus torchrun and a Jupyter kernel. ``make userflow`` runs the full grid and prints
its table (tests/userflow/grid.py).
"""

from __future__ import annotations

import pytest

from lightning_par.strategies.registry import plugin_names
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
