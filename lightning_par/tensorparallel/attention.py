"""Multi-head attention split by heads (Megatron-LM, Shoeybi et al., 2019, section 3,
figure 3b): rank ``k`` holds the query, key and value projections of its heads (a column
cut of ``in_proj_weight``, three blocks q, k, v) and the matching input columns of the
output projection (a row cut). Heads attend independently, so the only messages are
Megatron's two: ``f`` before the projections (identity forward, allreduce backward) and
``g`` after the output projection (allreduce forward).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lightning_par.split import offsets
from lightning_par.tensorparallel.layers import RowParallelLinear, _Parallel
from lightning_par.tensorparallel.mappings import TPGroup, copy_to, gather_from
from lightning_par.tensorparallel.shard import Shard


def attention_reason(mha: nn.MultiheadAttention, p: int, training_dropout: bool = True) -> str:
    """Why ``mha`` cannot be split exactly over ``p`` ranks ("" when it can)."""
    if not mha._qkv_same_embed_dim:
        return "keys or values of another width than the queries (kdim/vdim)"
    if mha.bias_k is not None or mha.add_zero_attn:
        return "add_bias_kv or add_zero_attn"
    if mha.num_heads < p:
        return f"{mha.num_heads} heads cannot be split over {p} ranks"
    if mha.dropout and training_dropout:
        return (
            f"attention dropout {mha.dropout}: its masks are drawn inside torch's attention "
            "kernel, so a split cannot draw the same ones (set dropout=0 in the attention)"
        )
    return ""


def _float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None or mask.is_floating_point():
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, -math.inf)


class ParallelMultiheadAttention(_Parallel):
    """``nn.MultiheadAttention`` with its heads split: rank ``k`` computes ``heads[k]`` heads.

    Same call and results as ``nn.MultiheadAttention`` (float tolerance), with
    ``need_weights`` gathering the heads' weights. Parameter names are the original's
    (``in_proj_weight``, ``in_proj_bias``, ``out_proj.weight``, ``out_proj.bias``).
    """

    def __init__(self, mha: nn.MultiheadAttention, group: TPGroup, heads: Sequence[int]) -> None:
        why = attention_reason(mha, len(heads), training_dropout=False)
        if why:
            raise ValueError(f"tensor_parallel cannot split this attention: {why}")
        self.head_dim = mha.embed_dim // mha.num_heads
        sizes = tuple(h * self.head_dim for h in heads)
        super().__init__(group, sizes)
        self.heads, self.num_heads = tuple(heads), mha.num_heads
        self.embed_dim, self.batch_first, self.dropout = mha.embed_dim, mha.batch_first, mha.dropout
        self._qkv_same_embed_dim = False  # keeps nn.Transformer*Layer off its fused fast path
        self._take("in_proj_weight", mha.in_proj_weight, Shard(0, sizes, groups=3))
        self._take("in_proj_bias", mha.in_proj_bias, Shard(0, sizes, groups=3))
        self.out_proj = RowParallelLinear(mha.out_proj, group, sizes)
        self.first_head = offsets(heads)[group.rank]

    def _heads(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        batch, length, _ = x.shape
        y = F.linear(x, w, b).view(batch, length, self.heads[self.group.rank], self.head_dim)
        return y.transpose(1, 2)  # [B, h, T, d]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.dropout and self.training:
            raise RuntimeError(attention_reason(self, 1))  # type: ignore[arg-type]
        if query.dim() != 3:
            raise ValueError("the split attention takes batched inputs [B, T, E] or [T, B, E]")
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        same = key is query and value is query  # self-attention: one f, one backward allreduce
        q_in = copy_to(query, self.group)
        k_in = q_in if same else copy_to(key, self.group)
        v_in = q_in if same else copy_to(value, self.group)
        wq, wk, wv = self.in_proj_weight.chunk(3)
        bq, bk, bv = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None,) * 3
        q, k, v = self._heads(q_in, wq, bq), self._heads(k_in, wk, bk), self._heads(v_in, wv, bv)

        scores = (q / math.sqrt(self.head_dim)) @ k.transpose(-2, -1)  # [B, h, T, S]
        batch, length, source = q.shape[0], q.shape[2], k.shape[2]
        if attn_mask is None and is_causal:
            attn_mask = torch.ones(length, source, dtype=torch.bool, device=q.device).triu(1)
        mask = _float_mask(attn_mask, scores.dtype)
        if mask is not None:
            if mask.dim() == 3:  # [B * heads, T, S]: this rank's heads
                mine = slice(self.first_head, self.first_head + self.heads[self.group.rank])
                mask = mask.view(batch, self.num_heads, length, source)[:, mine]
            scores = scores + mask
        padding = _float_mask(key_padding_mask, scores.dtype)
        if padding is not None:
            scores = scores + padding.view(batch, 1, 1, source)
        weights = scores.softmax(-1)
        out = (weights @ v).transpose(1, 2).reshape(batch, length, -1)
        out = self.out_proj(out)
        if not self.batch_first:
            out = out.transpose(0, 1)
        if not need_weights:
            return out, None
        every = gather_from(weights, self.group, self.heads, 1)
        return out, every.mean(1) if average_attn_weights else every
