"""Ring attention called directly at cp=2, in tiles of 3 query rows (the library's tiles are larger:
here every block is cut, most tiles' masks are partial, some are empty), against eager attention over
the whole sequence: grouped-query heads, a random mask, with and without rows that see no key
(eager spreads them evenly: the math path). Checks run in test_parity.py's spawn."""

import torch
import torch.distributed as dist

from shardformer.context_parallel.layout import ZigzagLayout
from shardformer.context_parallel.ring import ring_attention
from tests.helpers import GRAD_ATOL, GRAD_RTOL, assert_close

TILE = 3


def _eager(q, k, v, mask, scale):
    """Eager attention: the dtype's minimum added to masked scores (a row without keys spreads evenly)."""
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    bias = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    return torch.softmax(q @ k.transpose(-1, -2) * scale + bias, dim=-1) @ v


def _ring_in_small_tiles(dead_rows: bool):
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = ZigzagLayout(4 * world * 5, world, rank)  # 5 tokens per chunk
    full = layout.full_len
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, full, 8, generator=g)
    k, v = (torch.randn(2, 2, full, 8, generator=g) for _ in range(2))
    mask = torch.rand(2, 1, full, full, generator=g) < 0.3
    mask[..., torch.arange(full), torch.arange(full)] = True  # every row sees a key...
    if dead_rows:
        mask[0, :, 3:9] = False  # ...but these
    dead = ~mask.any(-1, keepdim=True)
    mine = layout.indices()
    local = [t.index_select(2, mine).clone().requires_grad_() for t in (q, k, v)]

    def tiles(source, _rows_per_tile):
        block = (mask | dead)[:, :, mine][..., layout.indices_of(source)]
        for start in range(0, layout.local_len, TILE):
            rows = slice(start, start + TILE)
            if block[:, :, rows].any():
                yield rows, None if block[:, :, rows].all() else block[:, :, rows]

    scale = 0.3
    local_dead = dead[:, :, mine] if dead_rows else None
    out = ring_attention(*local, tiles, scale, None, local_dead)
    full_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = _eager(*full_inputs, mask, scale)
    what = f"ring in tiles of {TILE} rows, {'with' if dead_rows else 'no'} rows without keys"
    assert_close(out, expected[:, :, mine].detach(), what=f"{what}: output")
    weights = torch.randn(expected.shape, generator=g)
    (out * weights[:, :, mine]).sum().backward()
    (expected * weights).sum().backward()
    for name, got, want in zip("qkv", local, full_inputs):
        assert_close(got.grad, want.grad[:, :, mine], GRAD_ATOL, GRAD_RTOL, f"{what}: d{name}")


def check_ring_in_small_tiles():
    _ring_in_small_tiles(dead_rows=False)


def check_ring_in_small_tiles_with_rows_without_keys():
    _ring_in_small_tiles(dead_rows=True)


CHECKS = [check_ring_in_small_tiles, check_ring_in_small_tiles_with_rows_without_keys]
