"""How a column projection's output features may be cut over tp ranks: evenly, in fused blocks
(``[Q | K | V]`` in 3, ``[gate | up]`` in 2), or by the heads of the model's config (``[Q | K | V]`` sized
by the head counts: grouped or multi-query attention). `.simulate` tries them on the recorded inputs.
"""

from __future__ import annotations

from shardformer.policies.tp_plan.heads import head_sizes


def nearest_config(root, path: str):
    """The config whose head counts a projection at ``path`` below ``root`` is cut by: that of the nearest
    module at or above it holding one with heads (a sub-model's own: PI0's action expert beside its vision-
    language model, whose top config counts no heads), else ``root``'s (None: a timm or plain module)."""
    parts = path.split(".") if path else []
    for depth in range(len(parts), -1, -1):
        config = getattr(root.get_submodule(".".join(parts[:depth])), "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if hasattr(config, "to_dict") and head_sizes(text) is not None:
            return config
    return getattr(root, "config", None)


def head_width(config) -> int | None:
    """The width of one attention head from ``config`` (its text config), as the plan route reads it."""
    sizes = head_sizes(config.get_text_config() if hasattr(config, "get_text_config") else config)
    return sizes[2] if sizes else None


def head_blocks(width: int, config) -> tuple[int, ...] | None:
    """The blocks of a projection sized by the heads of ``config``, when its width is not a plain
    multiple of the query heads: ``(q, k, v)`` of a fused projection with fewer key/value heads
    (grouped or multi-query: ``(H + 2 kv) d``), ``(k, v)`` of a fused key/value one (``2 kv d``),
    or ``(k,)`` of a key or value projection of fewer heads (``kv d``)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    sizes = head_sizes(text)  # None for a per-layer config (Dots3 Note's): no global head count
    heads, d = (sizes[0], sizes[2]) if sizes else (None, None)
    if not isinstance(heads, int) or not d or width % d:
        return None
    units = width // d
    if units > heads and (units - heads) % 2 == 0 and (units - heads) // 2 < heads:
        kv = (units - heads) // 2
        return heads * d, kv * d, kv * d
    if units < heads and units % 2 == 0 and heads % (units // 2) == 0 and units // 2 < heads:
        return units // 2 * d, units // 2 * d
    if units < heads and heads % units == 0:
        return (width,)
    return None


def cut_options(spec, width: int, config) -> dict:
    """``n_cast`` (and ``head_width`` for a cut by heads) of a column's cut, as the layers take them."""
    if spec == ("heads",):
        return {"n_cast": head_blocks(width, config), "head_width": head_width(config)}
    return {"n_cast": spec}


def block_widths(width: int, options, config) -> set[int]:
    """The widths of the blocks ``options`` cut a column of ``width`` into, beyond the whole: the width a
    module's code may read to split the column (Exaone 4.5's vision ``q_dim`` and ``kv_dim`` of its fused qkv)."""
    found = set()
    for spec in options:
        if spec == ("heads",):
            found |= set(head_blocks(width, config) or ())
        elif spec > 1:
            found.add(width // spec)
    return found


def fits_blocks(width: int, blocks, tp: int) -> bool:
    """Whether a width in ``blocks`` (a count of equal blocks, or their sizes) cuts every block over ``tp``."""
    if blocks is None:
        return False
    sizes = blocks if isinstance(blocks, tuple) else (width // blocks,) * blocks if width % blocks == 0 else None
    return sizes is not None and all(s % tp == 0 and s >= tp for s in sizes)


def _by_heads(width: int, config, tp: int) -> bool:
    """Whether the head blocks of a projection cut over ``tp`` into whole heads or replicate evenly."""
    blocks, d = head_blocks(width, config), head_width(config)
    if blocks is None or not d:
        return False
    return all((b // d) % tp == 0 or tp % (b // d) == 0 for b in blocks)


def column_candidates(width: int, config, tp: int) -> list:
    """The cuts of a column of output ``width`` to try, the simplest first: even, 3 blocks, 2, by heads."""
    out = [n for n in (1, 3, 2) if fits_blocks(width, n, tp)]
    if _by_heads(width, config, tp):
        out.append(("heads",))
    return out
