"""Stages 2-3 never hold a whole copy of the gradients during a step.

ZeRO stage 2 (Rajbhandari et al., 2020, section 5.2) reduce-scatters each bucket of
gradients as backward produces it and keeps only this rank's shard, so the gradients a rank
holds stay near ``4Ψ / p`` bytes plus the few buckets in flight. On two ranks, the peak of
live tensor storage in a step (counted by the bench's
:class:`~lightning_par.bench._live_bytes.LiveStorages`) above what the step started with
must therefore stay well below ``4Ψ``, one whole copy: under ``3Ψ`` (``2Ψ`` for the
shards, the rest for the units in flight) on a deep MLP cut into many units.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par.bench._live_bytes import LiveStorages
from lightning_par.bench._zero_run import WideMLP
from lightning_par.comm import run_on_ranks
from lightning_par.strategies.zero import ZeroStrategy
from tests.test_allreduce_strategies import trainer

WIDTH, DEPTH, BATCH, STEPS = 256, 16, 8, 3


class GrowthOfLastStep(pl.Callback):
    """How far live tensor storage rose above its start during the last step."""

    def __init__(self, exclude: list[torch.Tensor]) -> None:
        self.exclude, self.growth = exclude, 0

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == STEPS - 1:
            self.live = LiveStorages(exclude=self.exclude).__enter__()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == STEPS - 1:
            self.live.__exit__(None, None, None)
            self.growth = self.live.peak - self.live.at_start


def _growth(rank: int, world: int, stage: int) -> tuple[int, int]:
    torch.manual_seed(0)
    model = WideMLP(WIDTH, DEPTH)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(BATCH * STEPS, WIDTH, generator=g)
    y = torch.randint(0, 10, (BATCH * STEPS,), generator=g)
    probe = GrowthOfLastStep([x, y])
    # a unit per layer (a layer's weight is 256 KiB), so that backward finishes many in turn
    strategy = ZeroStrategy(stage=stage, bucket_cap_mb=0.3)
    trainer(strategy, world, max_steps=STEPS, callbacks=[probe]).fit(
        model, DataLoader(TensorDataset(x, y), batch_size=BATCH)
    )
    return probe.growth, sum(q.numel() for q in model.parameters())


@pytest.mark.parametrize("stage", [2, 3])
def test_a_step_never_holds_a_whole_copy_of_the_gradients(stage):
    for rank, (growth, psi) in enumerate(run_on_ranks(_growth, 2, stage, timeout=300)):
        assert growth < 3 * psi, (
            f"stage {stage}, rank {rank}: live storage rose by {growth} bytes in a step, "
            f"{growth / (4 * psi):.2f} of a whole copy of the gradients ({4 * psi} bytes)"
        )
