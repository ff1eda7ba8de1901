"""Bytes each rank of a hybrid grid sends per training step, from the cost models of its two
parts: the pipeline's activations and gradients at the stage cuts of its row (for the
replica's batch, the global batch / ``dp``; Huang et al., 2019), plus the data-parallel
allreduce of its stage's gradient buckets over its column (each bucket holds its gradients
and one flag per parameter, as :mod:`lightning_par.comm.buckets` packs them)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_par.collectives.cost_model import bucketed_allreduce_bytes as allreduce_bytes
from lightning_par.graphcut import split_module
from lightning_par.graphcut.cost import split_bytes
from lightning_par.hybrid.grid import Grid
from lightning_par.pipeline.cost import pipeline_bytes
from lightning_par.pipeline.partition import balance_by_params, split_sequential


def hybrid_bytes_per_step(
    net: nn.Module,
    grid: Grid,
    global_batch: int,
    *,
    dp_algorithm: str = "ring",
    bucket_cap_mb: float = 4.0,
    sample_shape: tuple[int, ...] = (3, 32, 32),
) -> list[int]:
    """Per global rank: bytes sent in one step of a pipelined (``gpipe``, or ``layerwise``
    without ``time_chunk``) hybrid grid whose stages are balanced by parameters."""
    batch = torch.zeros(global_batch // grid.dp, *sample_shape)
    if isinstance(net, nn.Sequential):
        pipeline = pipeline_bytes(net, grid.mp, batch)
        stages: list[nn.Module] = split_sequential(net, balance_by_params(net, grid.mp))
    else:  # any other network: cut from its traced graph, as the strategy cuts it
        split = split_module(net, (batch,), num_stages=grid.mp)
        pipeline = split_bytes(split, batch)
        stages = [stage.module for stage in split.stages]
    rings = [allreduce_bytes(stage, dp_algorithm, grid.dp, bucket_cap_mb) for stage in stages]
    return [
        int(pipeline[m] + rings[m][d]) for d, m in (grid.coords(r) for r in range(grid.world_size))
    ]
