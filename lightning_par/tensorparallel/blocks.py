"""The automatic plan for the blocks real networks are made of, beyond ``nn.Sequential``
pairs: attention split by heads, embeddings by vocabulary, and torch's Transformer layers
(their attention by heads, their feed-forward ``linear1 -> dropout -> linear2`` as a
column -> row pair, Megatron's transformer layer, Shoeybi et al., 2019, figure 3)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from lightning_par.tensorparallel.attention import attention_reason
from lightning_par.tensorparallel.cuts import (
    ELEMENTWISE,
    SHARED,
    Cut,
    Plan,
    between_cuts,
    join,
    pair_sizes,
    shares,
)
from lightning_par.tensorparallel.embedding import embedding_reason
from lightning_par.tensorparallel.shard import unit_sizes

#: style -> (module types it splits, how to say so)
EXPECTED = {
    "lstm": (nn.LSTM, "an nn.LSTM"),
    "heads": (nn.MultiheadAttention, "an nn.MultiheadAttention"),
    "vocab": (nn.Embedding, "an nn.Embedding"),
}
TRANSFORMER_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
ELEMENTWISE_FUNCTIONS = (F.relu, F.gelu, F.silu, F.tanh)
#: The blocks this file cuts
BLOCKS = (nn.MultiheadAttention, nn.Embedding, *TRANSFORMER_LAYERS)


def _heads(mha: nn.MultiheadAttention, p: int) -> tuple[int, ...]:
    return unit_sizes(mha.num_heads, p)


def user_block(name: str, module: nn.Module, style: str, p: int) -> Cut:
    """The cut a user plan asks for with ``"heads"`` or ``"vocab"``, or ``ValueError``."""
    if style == "heads":
        why = attention_reason(module, p)
        sizes = _heads(module, p) if not why else ()
    else:
        why = embedding_reason(module, p)
        sizes = unit_sizes(module.num_embeddings, p) if not why else ()
    if why:
        raise ValueError(f"tensor_parallel plan: {name!r}: {why}")
    return Cut(name, style, sizes)


def _feed_forward(layer: nn.Module, prefix: str, p: int, plan: Plan) -> None:
    activation = layer.activation
    if not (activation in ELEMENTWISE_FUNCTIONS or isinstance(activation, ELEMENTWISE)):
        plan.replicated[join(prefix, "linear1")] = f"activation {activation!r} is not elementwise"
        return
    sizes, why = pair_sizes(layer.linear1, [], layer.linear2, p)
    if sizes is None:
        plan.replicated[join(prefix, "linear1")] = why
        return
    plan.cuts.append(Cut(join(prefix, "linear1"), "column", sizes))
    plan.cuts += between_cuts([(join(prefix, "dropout"), layer.dropout)], layer.linear1, sizes)
    plan.cuts.append(Cut(join(prefix, "linear2"), "row", sizes))


def auto_block(module: nn.Module, prefix: str, p: int, plan: Plan, tied: set[int]) -> bool:
    """Add ``module``'s cuts to ``plan`` if it is a block this file knows (``True``), else
    leave it to the ``nn.Sequential`` walk (``False``)."""
    if isinstance(module, BLOCKS) and shares(module, tied):
        plan.replicated[prefix] = SHARED  # a tied embedding, a layer applied twice
        return True
    if isinstance(module, nn.MultiheadAttention):
        why = attention_reason(module, p)
        if why:
            plan.replicated[prefix] = why
        else:
            plan.cuts.append(Cut(prefix, "heads", _heads(module, p)))
        return True
    if isinstance(module, nn.Embedding):
        why = embedding_reason(module, p)
        if why:
            plan.replicated[prefix] = why
        else:
            plan.cuts.append(Cut(prefix, "vocab", unit_sizes(module.num_embeddings, p)))
        return True
    if isinstance(module, TRANSFORMER_LAYERS):
        for attention in ("self_attn", "multihead_attn"):
            if hasattr(module, attention):
                auto_block(getattr(module, attention), join(prefix, attention), p, plan, tied)
        _feed_forward(module, prefix, p, plan)
        return True
    return False
