"""Tensor (intra-layer) parallelism, Megatron-style, as plain modules (no Lightning).

Shoeybi et al., 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using
Model Parallelism" (arXiv:1909.08053): each rank holds a slice of a layer's weight, and the
conjugate operators ``f``/``g`` (:mod:`.mappings`) keep the activations exact.

``parallelize(module, group, plan=None)`` cuts a model in place (:mod:`.plan`, with
:mod:`.cuts` and :mod:`.blocks` for what the automatic plan recognises);
:mod:`.layers` has the split Linear, Conv2d, norm and LSTM layers, :mod:`.attention` the
attention split by heads, :mod:`.embedding` the vocabulary-split embedding and dropout on
split activations; :mod:`.shard` converts state dicts and optimiser states
to and from one process's.
"""

from lightning_par.tensorparallel.attention import ParallelMultiheadAttention
from lightning_par.tensorparallel.embedding import ShardedDropout, VocabParallelEmbedding
from lightning_par.tensorparallel.layers import (
    ColumnParallelConv2d,
    ColumnParallelLinear,
    ParallelLSTM,
    RowParallelConv2d,
    RowParallelLinear,
    split_norm,
)
from lightning_par.tensorparallel.mappings import (
    TPGroup,
    all_gather,
    copy_to,
    gather_from,
    gather_recurrent,
    reduce_from,
    reduce_scatter,
    split_to,
)
from lightning_par.tensorparallel.plan import STYLES, Cut, Plan, as_group, parallelize, resolve_plan
from lightning_par.tensorparallel.shard import (
    Shard,
    assemble_optimizer_state,
    assemble_state_dict,
    module_shards,
    parameter_shards,
    shard_optimizer_state,
    shard_state_dict,
)

__all__ = [
    "STYLES",
    "ColumnParallelConv2d",
    "ColumnParallelLinear",
    "Cut",
    "ParallelLSTM",
    "ParallelMultiheadAttention",
    "Plan",
    "RowParallelConv2d",
    "RowParallelLinear",
    "Shard",
    "ShardedDropout",
    "TPGroup",
    "VocabParallelEmbedding",
    "all_gather",
    "as_group",
    "assemble_optimizer_state",
    "assemble_state_dict",
    "copy_to",
    "gather_from",
    "gather_recurrent",
    "module_shards",
    "parallelize",
    "parameter_shards",
    "reduce_from",
    "reduce_scatter",
    "resolve_plan",
    "shard_optimizer_state",
    "shard_state_dict",
    "split_norm",
    "split_to",
]
