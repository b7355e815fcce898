"""torch's ``nn.MultiheadAttention`` over tensor-parallel ranks, each holding ``num_heads / tp`` heads.

``nn.MultiheadAttention`` packs q, k and v in one Parameter (``in_proj_weight``, ``[3E, E]``) and
runs ``F.multi_head_attention_forward``, which reads the heads' total width off the input: a rank's
share of the weight cannot run through it. This layer holds the rank's ``[Q_r | K_r | V_r]`` rows of
``in_proj_weight`` (and bias), computes attention on its heads, and its ``out_proj`` is a row-parallel
linear (one all-reduce): the Megatron cut of attention, for torch's own module. The forward takes
``nn.MultiheadAttention``'s arguments and applies masks as torch does (``True`` in a boolean mask: not
allowed; a float mask is added).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardformer.core.comm import group_rank, group_size, reduce_from_parallel
from shardformer.tensor_parallel.layers.linear import Linear1D_Row
from shardformer.tensor_parallel.regions import copy_to_parallel
from shardformer.tensor_parallel.slicer import Slicer


def refusal(module: nn.MultiheadAttention, tp: int) -> str | None:
    """Why ``module`` cannot be cut over ``tp`` ranks by this layer, or None."""
    if not module._qkv_same_embed_dim:
        return "it has separate q/k/v weights (kdim or vdim differ from embed_dim)"
    if module.bias_k is not None or module.add_zero_attn:
        return "it adds a learned key/value bias or a zero attention position (add_bias_kv, add_zero_attn)"
    if module.num_heads % tp:
        return f"its {module.num_heads} heads do not split over tensor_parallel_size={tp}"
    return None


def _float_mask(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """torch's mask convention: a boolean mask is True where attention is not allowed; a float one is added."""
    if mask is None or mask.is_floating_point():
        return mask
    return torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill(mask, float("-inf"))


@dataclass(frozen=True)
class Heads:
    """This rank's share of an attention's heads: ``local`` of ``total``, each ``width`` wide."""

    local: int
    total: int
    width: int
    process_group: object = None


def attend(
    heads: Heads, qkv, weights, biases, out_proj, batch_first, key_padding_mask, attn_mask, dropout,
    need_weights=True, average_attn_weights=True, is_causal=False,
):  # fmt: skip
    """``F.multi_head_attention_forward`` on this rank's heads: ``weights`` and ``biases`` are the rank's
    rows of q, k and v, ``out_proj`` maps the heads' outputs to the stream (all-reducing them). Returns
    the output and the attention weights averaged over every head (or None)."""
    query, key, value = qkv
    if need_weights and not average_attn_weights:
        raise NotImplementedError(
            "per-head attention weights (average_attn_weights=False) of a tensor-parallel "
            "multi-head attention are spread over ranks; ask for need_weights=False or averaged weights"
        )
    unbatched = query.dim() == 2  # (L, E): one sequence
    if unbatched or not batch_first:
        query, key, value = (t.unsqueeze(0) if unbatched else t.transpose(0, 1) for t in (query, key, value))
        key_padding_mask = (
            key_padding_mask.unsqueeze(0) if unbatched and key_padding_mask is not None else key_padding_mask
        )
    batch, length, source = query.shape[0], query.shape[1], key.shape[1]
    inputs = {}  # one identity-forward / all-reduce-backward per distinct input (self-attention: one)
    q, k, v = (
        F.linear(inputs.setdefault(id(t), copy_to_parallel(t, heads.process_group)), w, b)
        .view(batch, -1, heads.local, heads.width)
        .transpose(1, 2)
        for t, w, b in zip((query, key, value), weights, biases)
    )
    mask = _mask(heads, attn_mask, key_padding_mask, q, batch, length, source)
    if need_weights:
        scores = q @ k.transpose(-2, -1) / heads.width**0.5
        if is_causal and mask is None:
            mask = _float_mask(torch.ones(length, source, dtype=torch.bool, device=q.device).triu(1), q)
        probs = (scores if mask is None else scores + mask).softmax(dim=-1)
        probs = F.dropout(probs, dropout) if dropout else probs
        out = probs @ v
        averaged = reduce_from_parallel(probs.sum(dim=1), heads.process_group) / heads.total
    else:
        out = F.scaled_dot_product_attention(q, k, v, mask, dropout, is_causal=is_causal and mask is None)
        averaged = None
    out = out_proj(out.transpose(1, 2).reshape(batch, length, heads.local * heads.width))
    if unbatched:
        return out.squeeze(0), None if averaged is None else averaged.squeeze(0)
    return (out if batch_first else out.transpose(0, 1)), averaged


def _mask(heads: Heads, attn_mask, key_padding_mask, like, batch, length, source):
    """One additive mask ``[batch or 1, heads or 1, length, source]`` of this rank's heads."""
    mask = _float_mask(attn_mask, like)
    if mask is not None and mask.dim() == 3:  # [batch * heads, L, S]: this rank's heads of each batch row
        start = group_rank(heads.process_group) * heads.local
        mask = mask.view(batch, heads.total, length, source)[:, start : start + heads.local]
    padding = _float_mask(key_padding_mask, like)
    if padding is not None:
        padding = padding.view(batch, 1, 1, source)
        mask = padding if mask is None else mask + padding
    return mask


class ParallelMultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` with this rank's heads (see the module's text)."""

    def __init__(self, module: nn.MultiheadAttention, process_group=None) -> None:
        super().__init__()
        tp, rank = group_size(process_group), group_rank(process_group)
        why = refusal(module, tp)
        if why is not None:
            raise ValueError(f"nn.MultiheadAttention cannot be cut over tensor-parallel ranks: {why}")
        slicer = Slicer(rank, tp)
        self.process_group = process_group
        self.embed_dim, self.batch_first, self.dropout = module.embed_dim, module.batch_first, module.dropout
        self.total_heads, self.num_heads, self.head_dim = module.num_heads, module.num_heads // tp, module.head_dim
        self.in_proj_weight = slicer.column_weight(module.in_proj_weight, n_cast=3)
        self.in_proj_bias = None if module.in_proj_bias is None else slicer.column_bias(module.in_proj_bias, n_cast=3)
        self.out_proj = Linear1D_Row.from_native(module.out_proj, process_group)
        # TransformerEncoderLayer's fused inference path reads the module's weights as whole ones: it is
        # taken only when this is True, so the layer's own forward (this one's) always runs
        self._qkv_same_embed_dim = False
        self.in_proj_container = None

    def forward(
        self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
        average_attn_weights=True, is_causal=False,
    ):  # fmt: skip
        biases = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None, None, None)
        heads = Heads(self.num_heads, self.total_heads, self.head_dim, self.process_group)
        return attend(
            heads, (query, key, value), self.in_proj_weight.chunk(3), biases, self.out_proj, self.batch_first,
            key_padding_mask, attn_mask, self.dropout if self.training else 0.0, need_weights,
            average_attn_weights, is_causal,
        )  # fmt: skip

    @classmethod
    def from_native(cls, module: nn.MultiheadAttention, process_group=None, **_) -> ParallelMultiheadAttention:
        return cls(module, process_group)
