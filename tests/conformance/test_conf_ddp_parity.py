"""Lightning's DDP parity test, written anew for every data-parallel plugin (after
``Lightning-AI/pytorch-lightning``, ``tests/tests_fabric/parity/test_parity_ddp.py``: a
ConvNet on random 3x32x32 images trained by Fabric and by raw torch DDP in the same
processes, state dicts compared). Here each plugin under a Lightning ``Trainer`` trains 120
SGD steps from the same weights on the same batches as ``torch.nn.parallel.
DistributedDataParallel``; every rank's weights must be within float tolerance of torch
DDP's. The driver is :mod:`lightning_par.bench.parity`, which also reports the step-time
ratios (``python -m lightning_par.bench parity``); no time is asserted here.
"""

from __future__ import annotations

from lightning_par.bench.parity import PLUGINS, parity
from lightning_par.comm import run_on_ranks

STEPS = 120
#: float32, a different summation order of the same gradients (2 ranks: the same order)
ATOL = 1e-5


def test_every_data_parallel_plugin_matches_raw_torch_ddp_after_120_steps():
    per_rank = run_on_ranks(parity, 2, list(PLUGINS), STEPS, timeout=300)
    for rank, rows in enumerate(per_rank):
        assert set(rows) == {"torch_ddp", *PLUGINS}
        for name in PLUGINS:
            row = rows[name]
            assert row["steps"] == STEPS, (rank, name, row)
            assert row["moved"] > 1e-3, f"{name}: the weights did not change: {row}"
            assert row["diff"] < ATOL, f"rank {rank}, {name}: max |w - w_torch_ddp| = {row}"
