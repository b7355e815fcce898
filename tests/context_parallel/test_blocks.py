"""A ring step's tiles on one process: the fused kernel and the math path against autograd through
eager attention, and the model's mask cut into tiles against the whole block."""

import torch
from transformers.masking_utils import and_masks, padding_mask_function, sliding_window_causal_mask_function

from shardformer.context_parallel import blocks
from shardformer.context_parallel.attention import SplitMask
from shardformer.context_parallel.layout import ZigzagLayout
from tests.helpers import GRAD_ATOL, GRAD_RTOL, assert_close


def test_fused_and_math_tiles_match_autograd():
    """One block (so its output and log-sum-exp are the final ones): a partial mask with a row that sees
    no key (output 0, log-sum-exp -inf), grouped-query heads; both paths, forward and backward."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.rand(2, 1, 6, 9, generator=g) < 0.5
    mask[..., :2] = False  # keys no row sees: the kernel gets the span 2..8
    mask[..., 4, :] = False
    mask[..., 0, 2] = True
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    scores = (inputs[0] @ inputs[1].repeat_interleave(2, 1).transpose(-1, -2) * 0.5).masked_fill(~mask, -torch.inf)
    expected = torch.softmax(scores, -1).nan_to_num(0.0) @ inputs[2].repeat_interleave(2, 1)
    grad = torch.randn(expected.shape, generator=g, dtype=torch.float64)
    expected.backward(grad)
    q, k, v, grad = (t.float() for t in (q, k, v, grad))
    for path, forward in (("fused", blocks.tile_forward), ("math", blocks._math_forward)):
        out, lse = forward(q, k, v, mask, 0.5, None)
        assert_close(out.double(), expected.detach(), what=f"{path}: output")
        assert torch.isneginf(lse[..., 4]).all() and torch.isfinite(lse[..., :4]).all(), f"{path}: {lse}"
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        if path == "fused":
            dq = blocks.tile_backward(grad, q, k, v, out, blocks.finite(lse), mask, 0.5, None, (dk, dv))
        else:
            dq, dk, dv = blocks._math_backward(grad, q, k, v, out, blocks.finite(lse), mask, 0.5, None)
        assert not dk[:, :, :2].any(), "keys no row sees"
        for name, got, want in (("q", dq, inputs[0].grad), ("k", dk, inputs[1].grad), ("v", dv, inputs[2].grad)):
            assert_close(got.double(), want, GRAD_ATOL, GRAD_RTOL, f"{path}: d{name}")


def test_mask_tiles_cover_the_block():
    """Sliding window 4 over causal, a padded row, 13 tokens (padded to 16) at cp=2: tiles of 3 rows (they
    cross the head/tail chunk boundary) give the block's mask; empty tiles are left out, full ones are None;
    a second pass (the next layer, the backward) answers the same from what the first remembered."""
    padding = torch.ones(2, 16, dtype=torch.bool)
    padding[1, 10:] = False
    mask_function = and_masks(sliding_window_causal_mask_function(4), padding_mask_function(padding))
    for rank in range(2):
        layout = ZigzagLayout(13, 2, rank)
        split = SplitMask(layout, None, "ring", mask_function, padding, {}, "sdpa", None)
        for source in range(2):
            whole = split._pattern(source, slice(0, layout.local_len))
            for _ in range(2):
                got = torch.zeros_like(whole)
                for rows, mask in split.ring_tiles(source, 3):
                    assert mask is None or (mask.any() and not mask.all()), (rank, source, rows)
                    got[:, :, rows] = True if mask is None else mask
                assert torch.equal(got, whole), (rank, source)
        assert all(isinstance(kind, bool) for kind in split._tiles.values()), "a mask was kept"


def test_tiles_bound_the_mask_and_the_key_gradients():
    rows = blocks.tile_rows(1, 16384)
    assert rows * 16384 * 5 <= blocks.TILE_BYTES < (rows + 1) * 16384 * 5
    assert blocks.tile_rows(4, 10**9) == 1
    keys = blocks._key_rows(1, 32, 128)
    assert 4 * 32 * keys * 128 * 4 <= blocks.TILE_BYTES < 4 * 32 * (keys + 1) * 128 * 4


def test_key_spans_of_the_backward_add_up(monkeypatch):
    """The backward on spans of 3 keys (the kernel is separable over keys given the final output and
    log-sum-exp) gives the gradients of one call over all keys."""
    g = torch.Generator().manual_seed(1)
    q, k, v, grad = (torch.randn(1, 2, 5, 4, generator=g) for _ in range(4))
    mask = torch.rand(1, 1, 5, 5, generator=g) < 0.6
    mask[..., 0] = True
    out, lse = blocks.tile_forward(q, k, v, mask, 0.5)
    whole = [torch.zeros_like(k), torch.zeros_like(v)]
    dq_whole = blocks.tile_backward(grad, q, k, v, out, lse, mask, 0.5, None, whole)
    monkeypatch.setattr(blocks, "_key_rows", lambda *_: 3)
    spans = [torch.zeros_like(k), torch.zeros_like(v)]
    dq_spans = blocks.tile_backward(grad, q, k, v, out, lse, mask, 0.5, None, spans)
    for got, want in zip([dq_spans, *spans], [dq_whole, *whole]):
        assert_close(got, want, GRAD_ATOL, GRAD_RTOL, "key spans")
