"""Ulysses (all-to-all) attention: the sequence-split queries, keys and values become head-split
over the whole sequence, attention runs there with the model's own attention function and mask,
and the output goes back to sequence-split.

Two all-to-alls in forward (q/k/v in, output back), their mirrors in backward. Each rank must get
whole query heads: the local heads (after tensor parallelism) must divide by cp. Key/value heads
that do not divide (grouped-query attention with few of them) are repeated for the query heads
first, and the attention function is told every query head has its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardformer.core.comm import all_to_all, group_rank, group_size

PER_HEAD_ARGUMENTS = ("s_aux",)  # attention arguments with one value per query head (GPT-OSS's sinks)


class _AllToAll(torch.autograd.Function):
    """Row ``r`` of ``[world, ...]`` to rank ``r``; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, ctx.group), None


def _seq_to_heads(x: torch.Tensor, layout, group) -> torch.Tensor:
    """``[b, h, n, d]`` (this rank's tokens, every head) -> ``[b, h / cp, padded_len, d]`` (this rank's
    heads over the whole sequence, in order)."""
    b, h, n, d = x.shape
    cp = group_size(group)
    rows = x.reshape(b, cp, h // cp, n, d).transpose(0, 1)  # row r: the heads rank r computes
    got = _AllToAll.apply(rows, group)  # row r: rank r's tokens of this rank's heads
    rank_major = got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * n, d)
    return rank_major.index_select(2, layout.to_natural.to(x.device))


def _heads_to_seq(y: torch.Tensor, layout, group) -> torch.Tensor:
    """The inverse of `_seq_to_heads`: ``[b, h / cp, padded_len, d]`` -> ``[b, h, n, d]``."""
    b, hl, _, d = y.shape
    cp = group_size(group)
    n = layout.local_len
    rank_major = y.index_select(2, layout.rank_major.to(y.device))
    rows = rank_major.reshape(b, hl, cp, n, d).permute(2, 0, 1, 3, 4)  # row r: rank r's tokens
    got = _AllToAll.apply(rows, group)  # row r: this rank's tokens of rank r's heads
    return got.transpose(0, 1).reshape(b, cp * hl, n, d)


class _SeenAs:
    """The attention module as the attention function sees it on this rank, with some attributes
    changed: one key/value head per query head once they were repeated (nothing left to repeat),
    this rank's heads' sinks (GPT-OSS's eager attention reads ``module.sinks``)."""

    def __init__(self, module, **changed) -> None:
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_changed", changed)

    def __getattr__(self, name):
        changed = object.__getattribute__(self, "_changed")
        return changed[name] if name in changed else getattr(self._module, name)


def ulysses_attention(module, q, k, v, full_mask, attend, layout, group, **kwargs):
    """Attention of this rank's tokens over the whole sequence (transformers' output layout
    ``[b, n, h, d]``). ``attend`` is the model's own attention function, ``full_mask`` its mask over
    the whole sequence in order (its true length)."""
    cp = group_size(group)
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % cp != 0:
        raise ValueError(
            f"context_parallel_mode='all_to_all' gives each of the {cp} cp ranks whole attention heads, but "
            f"{type(module).__name__} has {heads} query heads on this rank (after tensor parallelism); use "
            f"context_parallel_mode='ring', or sizes with heads divisible by tensor_parallel_size x context_parallel_size"
        )
    changed = {}
    if kv_heads % cp != 0:
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        changed["num_key_value_groups"] = 1
    # the split's padding at the end is cut: the model's attention sees the sequence it would see
    q, k, v = (_seq_to_heads(t, layout, group).narrow(2, 0, layout.full_len) for t in (q, k, v))
    # per-head values (GPT-OSS's sinks) narrowed to this rank's heads; the other heads' gradient is
    # zero here, and the cp ranks' gradients are summed as for every parameter
    first, local = group_rank(group) * (heads // cp), heads // cp
    for name in PER_HEAD_ARGUMENTS:
        if kwargs.get(name) is not None:
            kwargs[name] = kwargs[name].narrow(0, first, local)
    sinks = getattr(module, "sinks", None)
    if torch.is_tensor(sinks) and sinks.dim() == 1 and sinks.shape[0] == heads:
        changed["sinks"] = sinks.narrow(0, first, local)
    out, _ = attend(_SeenAs(module, **changed) if changed else module, q, k, v, full_mask, **kwargs)
    out = F.pad(out.transpose(1, 2), (0, 0, 0, layout.padded_len - layout.full_len))
    out = _heads_to_seq(out, layout, group)
    return out.transpose(1, 2).contiguous()
