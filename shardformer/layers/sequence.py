"""Collectives along the sequence dimension (dim 1 of ``[batch, seq, hidden]``), for sequence parallelism.

    split_sequence            forward: keep own chunk      backward: all-gather
    gather_sequence           forward: all-gather          backward: keep own chunk
    gather_sequence_for_tp    forward: all-gather          backward: reduce-scatter
    reduce_scatter_sequence   forward: reduce-scatter      backward: all-gather

A sequence of ``full_len`` tokens is cut into ``world`` chunks of ``ceil(full_len / world)``; the
last chunks carry zero padding, which never leaves the split region: gathers cut it off, and the
gradient of a padding position is zero.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from shardformer.layers.comm import _functional_group, _record, all_gather
from shardformer.mesh import group_rank, group_size

SEQ_DIM = 1


def chunk_length(full_len: int, world: int) -> int:
    return -(-full_len // world)


def _pad(x: torch.Tensor, length: int) -> torch.Tensor:
    missing = length - x.shape[SEQ_DIM]
    if missing == 0:
        return x
    pad = [0, 0] * (x.dim() - SEQ_DIM - 1) + [0, missing]  # F.pad counts dimensions from the last
    return F.pad(x, pad)


def own_chunk(x: torch.Tensor, group, full_len: int) -> torch.Tensor:
    """This rank's chunk of a full-length ``x`` (padded at the end where the length does not divide)."""
    world = group_size(group)
    local = chunk_length(full_len, world)
    return _pad(x, local * world).narrow(SEQ_DIM, group_rank(group) * local, local).contiguous()


def _all_gather(x: torch.Tensor, group, full_len: int) -> torch.Tensor:
    return torch.cat(all_gather(x, group), dim=SEQ_DIM).narrow(SEQ_DIM, 0, full_len)


def _reduce_scatter(x: torch.Tensor, group, full_len: int) -> torch.Tensor:
    world = group_size(group)
    local = chunk_length(full_len, world)
    padded = _pad(x, local * world)
    if torch.compiler.is_compiling():  # functional collectives: dynamo traces them (counting is eager-only)
        return funcol.reduce_scatter_tensor(padded.contiguous(), "sum", SEQ_DIM, _functional_group(group))
    chunks = [c.contiguous() for c in padded.split(local, dim=SEQ_DIM)]
    out = torch.empty_like(chunks[0])
    _record("reduce_scatter", x)
    dist.reduce_scatter(out, chunks, group=group)
    return out


class _ToChunk(torch.autograd.Function):
    """Full sequence -> this rank's chunk: of the replicated input (``reduce`` False) or of the sum
    over ranks (``reduce`` True). Backward all-gathers the chunks' gradients either way."""

    @staticmethod
    def forward(ctx, x, group, full_len, reduce):
        ctx.group, ctx.full_len = group, full_len
        return _reduce_scatter(x, group, full_len) if reduce else own_chunk(x, group, full_len)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, ctx.full_len), None, None, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, full_len, reduce_grad):
        ctx.group, ctx.full_len, ctx.reduce_grad = group, full_len, reduce_grad
        return _all_gather(x, group, full_len)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:  # each rank holds a partial gradient of the whole sequence
            return _reduce_scatter(grad, ctx.group, ctx.full_len), None, None, None
        return own_chunk(grad, ctx.group, ctx.full_len), None, None, None


def split_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Replicated full sequence -> this rank's chunk (the gradient is all-gathered back)."""
    return _ToChunk.apply(x, group, x.shape[SEQ_DIM], False)


def gather_sequence(x: torch.Tensor, group, full_len: int) -> torch.Tensor:
    """Chunks -> the replicated full sequence (each rank's gradient of it is whole: keep own chunk)."""
    return _GatherSequence.apply(x, group, full_len, False)


def gather_sequence_for_tp(x: torch.Tensor, group, full_len: int) -> torch.Tensor:
    """Chunks -> the full sequence as input of column-parallel layers, whose input gradients are
    partial sums over the ranks: backward reduce-scatters them (Megatron's sequence parallelism)."""
    return _GatherSequence.apply(x, group, full_len, True)


def reduce_scatter_sequence(x: torch.Tensor, group, full_len: int) -> torch.Tensor:
    """Partial sums of the full sequence (a row-parallel output) -> this rank's chunk of the total."""
    return _ToChunk.apply(x, group, full_len, True)
