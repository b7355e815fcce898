"""One ring step's attention without its score block: a tile of this rank's queries against one
source rank's keys, giving the tile's partial output and its log-sum-exp (forward), or its share of
the gradients given the final output and log-sum-exp (backward), which the ring merges exactly.

A tile is at most `tile_rows` query rows, so that the model's mask over it (rows x keys booleans and
the additive bias made of them) stays within `TILE_BYTES`. On CPU a fused flash-attention kernel
computes the tile: it never holds more than its own small blocks of scores, returns the log-sum-exp,
and its backward takes the final output and log-sum-exp. A tile's keys are cut to the span its rows
see (a causal diagonal or a sliding window touches few). Elsewhere (another device, or a tile holding
rows that eager attention spreads evenly because they see no key) the tile is computed in matmuls, a
few rows at a time within the same budget: bounded, like the kernel, only slower.
"""

from __future__ import annotations

import torch

TILE_BYTES = 32 * 2**20  # the most a tile's mask, or the math path's scores, may take
_MASK_BYTES = 1 + 4  # a mask entry: the boolean and its float32 additive bias
_MATH_BYTES = 3 * 4  # a math-path score: the scores, the probabilities, their gradient (float32)

# torch.nn.functional.scaled_dot_product_attention returns no log-sum-exp, and flex_attention(return_lse=True)
# fuses only under torch.compile (eagerly it materialises the whole score matrix), so the CPU flash kernel
# is called as the aten op, as torch's own context parallelism calls its kernels.
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def tile_rows(batch: int, keys: int) -> int:
    """Query rows per tile: the tile's mask, ``batch x rows x keys``, fits `TILE_BYTES`."""
    return max(1, TILE_BYTES // (batch * keys * _MASK_BYTES))


def _math_rows(batch: int, heads: int, keys: int) -> int:
    return max(1, TILE_BYTES // (batch * heads * keys * _MATH_BYTES))


def finite(x: torch.Tensor) -> torch.Tensor:
    """-inf (a query that sees no key at all) as 0, so exp() of it minus -inf scores gives 0, not nan."""
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _fused(q: torch.Tensor, dead: torch.Tensor | None) -> bool:
    return q.device.type == "cpu" and (dead is None or not bool(dead.any()))


def _key_span(mask: torch.Tensor | None, keys: int) -> slice:
    """The keys any row of the tile sees (all of them without a mask)."""
    if mask is None:
        return slice(0, keys)
    seen = mask.any(-2).flatten(0, -2).any(0).nonzero()
    return slice(int(seen[0]), int(seen[-1]) + 1)


def _bias(mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if mask is None else torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))


def tile_forward(q, k, v, mask, scale, dead=None):
    """``q [b, h, t, d]`` (a tile of query rows) against ``k, v [b, h_kv, n, d]``, all float32, with
    ``mask [b, 1, t, n]`` (None: every pair attends; at least one pair does) and ``dead [b, 1, t, 1]``
    (rows scored as one constant, see `ring`) -> ``out [b, h, t, d]``, ``lse [b, h, t]`` (-inf for a
    row that sees no key here)."""
    if not _fused(q, dead):
        return _math_forward(q, k, v, mask, scale, dead)
    keys = _key_span(mask, k.shape[2])
    mask = None if mask is None else mask[..., keys]
    out, lse = _FLASH(q, k[:, :, keys], v[:, :, keys], 0.0, False, attn_mask=_bias(mask), scale=scale)
    if mask is not None:  # the kernel gives a row without keys lse 0; the merge needs -inf
        lse = lse.masked_fill(~mask.any(-1), float("-inf"))
    return out, lse


def tile_backward(grad_out, q, k, v, out, lse, mask, scale, dead, grads):
    """The tile's gradients given the FINAL ``out`` and finite ``lse`` of its rows (as `tile_forward`'s
    arguments otherwise) -> ``dq [b, h, t, d]``; the keys' and values' parts are added to ``grads``
    (``dk, dv`` float32, shaped as ``k, v``). The kernel's backward is separable over keys given the
    final output and log-sum-exp, so it runs on spans of `_key_rows` keys: what it allocates for their
    gradients stays within the tile budget too."""
    if not _fused(q, dead):
        dq, dk, dv = _math_backward(grad_out, q, k, v, out, lse, mask, scale, dead)
        grads[0].add_(dk)
        grads[1].add_(dv)
        return dq
    seen = _key_span(mask, k.shape[2])
    step = _key_rows(*q.shape[:2], q.shape[3])
    dq = torch.zeros_like(q)
    for start in range(seen.start, seen.stop, step):
        keys = slice(start, min(start + step, seen.stop))
        part = None if mask is None else mask[..., keys]
        if part is not None and not bool(part.any()):
            continue
        dq_part, dk, dv = _FLASH_BACKWARD(
            grad_out, q, k[:, :, keys], v[:, :, keys], out, lse, 0.0, False, attn_mask=_bias(part), scale=scale
        )
        dq += dq_part
        grads[0][:, :, keys] += dk
        grads[1][:, :, keys] += dv
    return dq


def _key_rows(batch: int, heads: int, head_dim: int) -> int:
    """Keys per backward kernel call: its key and value gradients and the kernel's float32 buffers for
    them (4 x batch x heads x keys x head_dim) fit `TILE_BYTES`."""
    return max(1, TILE_BYTES // (4 * batch * heads * head_dim * 4))


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


def _chunks(q, k):
    b, h, t, _ = q.shape
    step = _math_rows(b, h, k.shape[2])
    return [slice(r, min(r + step, t)) for r in range(0, t, step)]


def _part(x, rows):
    return None if x is None else x[:, :, rows]


def _math_forward(q, k, v, mask, scale, dead):
    groups = q.shape[1] // k.shape[1]
    kb, vb = _expand_heads(k, groups), _expand_heads(v, groups)
    outs, lses = [], []
    for rows in _chunks(q, kb):
        s = _scores(q[:, :, rows], kb, scale, _part(mask, rows), _part(dead, rows))
        lse = torch.logsumexp(s, dim=-1)
        outs.append(torch.matmul(torch.exp(s - finite(lse).unsqueeze(-1)), vb))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _math_backward(grad_out, q, k, v, out, lse, mask, scale, dead):
    groups = q.shape[1] // k.shape[1]
    kb, vb = _expand_heads(k, groups), _expand_heads(v, groups)
    delta = (grad_out * out).sum(-1, keepdim=True)  # rowsum(dO * O): the softmax's Jacobian term
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(kb), torch.zeros_like(vb)
    for rows in _chunks(q, kb):
        do = grad_out[:, :, rows]
        s = _scores(q[:, :, rows], kb, scale, _part(mask, rows), _part(dead, rows))
        p = torch.exp(s - lse[:, :, rows].unsqueeze(-1))  # masked pairs: exp(-inf) = 0
        dv += torch.matmul(p.transpose(-1, -2), do)
        ds = p * (torch.matmul(do, vb.transpose(-1, -2)) - delta[:, :, rows])
        dq[:, :, rows] = torch.matmul(ds, kb) * scale
        dk += torch.matmul(ds.transpose(-1, -2), q[:, :, rows]) * scale
    return dq, _fold_heads(dk, groups), _fold_heads(dv, groups)
