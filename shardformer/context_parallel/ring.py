"""Ring attention: exact attention over a sequence split over the cp ranks, with keys and values
passed around the ring.

Each rank keeps its queries; at step ``s`` it holds the keys/values of rank ``rank - s`` and
computes that block of attention (masked by the model's own mask evaluated at global positions),
merging blocks with an online softmax: a block's output and its log-sum-exp are folded into the
running ones. While a block computes, the next keys/values are already on their way.

Backward is the flash-attention backward, block by block with the final log-sum-exp (no block's
probabilities are kept from forward): the keys/values go round the ring again, and with them an
accumulator of their gradient, which after a full turn arrives back at the rank that owns them.
Memory per rank: the local queries/keys/values, one block of scores at a time.
"""

from __future__ import annotations

import torch

from shardformer.core.comm import group_rank, group_size, start_ring_shift


def _expand_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads repeated for the query heads that share them (grouped-query attention)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `_expand_heads`: each key/value head sums its query heads' parts."""
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x.view(b, h // groups, groups, s, d).sum(2)


def _scores(q, k, scale, mask, dead):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if dead is not None:  # eager's rows that see no key: one constant score for every key; backward's
        s = s.masked_fill(dead, 0.0)  # softmax gradient then flows to q and k as through eager's additive mask
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _finite(x: torch.Tensor) -> torch.Tensor:
    """-inf (a query that sees no key at all) as 0, so exp() of it minus -inf scores gives 0, not nan."""
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


class RingAttention(torch.autograd.Function):
    """``q [b, h, n, d]``, ``k, v [b, h_kv, n, d]`` (this rank's tokens) -> output ``[b, h, n, d]``.

    ``block_mask(source_rank)`` gives the boolean mask ``[b, 1, n, n]`` of this rank's queries
    against ``source_rank``'s keys (None: every pair attends; a mask with no True is skipped).
    ``dead`` ``[b, 1, n, 1]`` (or None): rows whose scores are one constant, so they spread evenly
    over the keys their mask admits (eager attention's rows that see no key).
    Computed in float32, returned in q's dtype.
    """

    @staticmethod
    def forward(ctx, q, k, v, block_mask, scale, group, dead=None):
        world, rank = group_size(group), group_rank(group)
        groups = q.shape[1] // k.shape[1]
        qf = q.float()
        out = torch.zeros_like(qf)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = (k, v)
        for step in range(world):
            handle = None
            if step + 1 < world:
                nxt, handle = start_ring_shift(list(kv), group)
            mask = block_mask((rank - step) % world)
            if mask is None or bool(mask.any()):
                kb, vb = (_expand_heads(t.float(), groups) for t in kv)
                s = _scores(qf, kb, scale, mask, dead)
                block_lse = torch.logsumexp(s, dim=-1)
                p = torch.exp(s - _finite(block_lse).unsqueeze(-1))
                block_out = torch.matmul(p, vb)
                new_lse = torch.logaddexp(lse, block_lse)
                safe = _finite(new_lse)
                out = out * torch.exp(lse - safe).unsqueeze(-1) + block_out * torch.exp(block_lse - safe).unsqueeze(-1)
                lse = new_lse
            if handle is not None:
                handle.wait()
                kv = tuple(nxt)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.block_mask, ctx.scale, ctx.group, ctx.dead = block_mask, scale, group, dead
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        block_mask, scale, group, dead = ctx.block_mask, ctx.scale, ctx.group, ctx.dead
        world, rank = group_size(group), group_rank(group)
        groups = q.shape[1] // k.shape[1]
        qf, do = q.float(), grad_out.float()
        delta = (do * out).sum(-1, keepdim=True)  # rowsum(dO * O): the softmax's Jacobian term
        lse = _finite(lse).unsqueeze(-1)
        dq = torch.zeros_like(qf)
        kv = (k, v)
        dkv = (torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32))
        for step in range(world):
            mask = block_mask((rank - step) % world)
            if mask is None or bool(mask.any()):
                kb, vb = (_expand_heads(t.float(), groups) for t in kv)
                p = torch.exp(_scores(qf, kb, scale, mask, dead) - lse)  # masked pairs: exp(-inf) = 0
                dv = torch.matmul(p.transpose(-1, -2), do)
                ds = p * (torch.matmul(do, vb.transpose(-1, -2)) - delta)
                dq = dq + torch.matmul(ds, kb) * scale
                dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
                dkv = (dkv[0] + _fold_heads(dk, groups), dkv[1] + _fold_heads(dv, groups))
            # keys/values move on (not after the last block); their gradient accumulators make the
            # full turn, so after the last shift each rank holds its own keys' and values' gradient
            moving = list(dkv) + (list(kv) if step + 1 < world else [])
            if world > 1:
                received, handle = start_ring_shift(moving, group)
                handle.wait()
                dkv = tuple(received[:2])
                if step + 1 < world:
                    kv = tuple(received[2:])
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def ring_attention(q, k, v, block_mask, scale, group, dead=None) -> torch.Tensor:
    return RingAttention.apply(q, k, v, block_mask, scale, group, dead)
