"""Ring attention: exact attention over a sequence split over the cp ranks, with keys and values
passed around the ring.

Each rank keeps its queries; at step ``s`` it holds the keys/values of rank ``rank - s`` and
computes that block of attention (masked by the model's own mask evaluated at global positions)
tile by tile of query rows (`.blocks`: a fused kernel, no score block), folding each tile's output
and log-sum-exp into the running ones (an online softmax). While a block computes, the next
keys/values are already on their way.

Backward is the flash-attention backward, tile by tile with the final output and log-sum-exp (no
probabilities are kept from forward): the keys/values go round the ring again, and with them an
accumulator of their gradient, which after a full turn arrives back at the rank that owns them.
Memory per rank: the local queries/keys/values, outputs and gradients, and one tile at a time.
"""

from __future__ import annotations

import torch

from shardformer.context_parallel.blocks import finite, tile_backward, tile_forward, tile_rows
from shardformer.core.comm import group_rank, group_size, start_ring_shift


def _rows(x: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if x is None else x[:, :, rows].contiguous()


def _merge(out, lse, rows, tile_out, tile_lse) -> None:
    """Fold a tile's partial output and log-sum-exp into the running ones (in place)."""
    old = lse[:, :, rows]
    new = torch.logaddexp(old, tile_lse)
    safe = finite(new)
    out[:, :, rows] = out[:, :, rows] * torch.exp(old - safe).unsqueeze(-1) + tile_out * torch.exp(
        tile_lse - safe
    ).unsqueeze(-1)
    lse[:, :, rows] = new


class RingAttention(torch.autograd.Function):
    """``q [b, h, n, d]``, ``k, v [b, h_kv, n, d]`` (this rank's tokens) -> output ``[b, h, n, d]``.

    ``tiles(source_rank, rows_per_tile)`` yields ``(rows, mask)`` for the tiles of this rank's query
    rows (slices of at most ``rows_per_tile``, in order) that see at least one of ``source_rank``'s
    keys: ``mask [b, 1, len(rows), n]`` bool, or None where every pair attends.
    ``dead`` ``[b, 1, n, 1]`` (or None): rows whose scores are one constant, so they spread evenly
    over the keys their mask admits (eager attention's rows that see no key).
    Computed in float32, returned in q's dtype.
    """

    @staticmethod
    def forward(ctx, q, k, v, tiles, scale, group, dead=None):
        world, rank = group_size(group), group_rank(group)
        rows_per_tile = tile_rows(q.shape[0], k.shape[2])
        qf = q.float()
        out = torch.zeros_like(qf)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = (k, v)
        for step in range(world):
            handle = None
            if step + 1 < world:
                nxt, handle = start_ring_shift(list(kv), group)
            kf, vf = (t.float() for t in kv)
            for rows, mask in tiles((rank - step) % world, rows_per_tile):
                tile_out, tile_lse = tile_forward(_rows(qf, rows), kf, vf, mask, scale, _rows(dead, rows))
                _merge(out, lse, rows, tile_out, tile_lse)
            if handle is not None:
                handle.wait()
                kv = tuple(nxt)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.tiles, ctx.scale, ctx.group, ctx.dead = tiles, scale, group, dead
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        tiles, scale, group, dead = ctx.tiles, ctx.scale, ctx.group, ctx.dead
        world, rank = group_size(group), group_rank(group)
        rows_per_tile = tile_rows(q.shape[0], k.shape[2])
        qf, do, lse = q.float(), grad_out.float(), finite(lse)
        dq = torch.zeros_like(qf)
        kv = (k, v)
        dkv = (torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32))
        for step in range(world):
            kf, vf = (t.float() for t in kv)
            for rows, mask in tiles((rank - step) % world, rows_per_tile):
                dq[:, :, rows] += tile_backward(
                    _rows(do, rows), _rows(qf, rows), kf, vf, _rows(out, rows), _rows(lse, rows),
                    mask, scale, _rows(dead, rows), dkv,
                )  # fmt: skip
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


def ring_attention(q, k, v, tiles, scale, group, dead=None) -> torch.Tensor:
    return RingAttention.apply(q, k, v, tiles, scale, group, dead)
