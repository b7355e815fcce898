"""Multimodal rotary sections of a tiny copy's head (Qwen2-VL's ``mrope_section``: time, height, width)."""

from __future__ import annotations


def rotary_sections(sections: list[int], total: int) -> list[int]:
    """Multimodal rotary sections (time, height, width: Qwen2-VL's ``mrope_section``) scaled to a head's
    ``total`` rotary pairs, in the same proportions as far as integers allow (each at least one where
    ``total`` allows it); sections of equal size stay equal where they can (Ernie 4.5 VL stacks its height
    and width sections), the odd one out taking the rounding first."""
    least = 1 if total >= len(sections) else 0
    scaled = [max(least, section * total // sum(sections)) for section in sections]
    while sum(scaled) < total:  # the largest sections first, a group of equal ones only while it fits whole
        short = total - sum(scaled)
        sizes = sorted(set(sections), reverse=True)
        size = next((s for s in sizes if sections.count(s) <= short), sizes[0])
        grown = [i for i, s in enumerate(sections) if s == size][:short]
        scaled = [v + (i in grown) for i, v in enumerate(scaled)]
    while sum(scaled) > total:
        for i in sorted(range(len(scaled)), key=lambda i: -sections[i]):
            if sum(scaled) > total and scaled[i] > least:
                scaled[i] -= 1
    return scaled


def rotary_head_dim(data: dict, head_dim: int) -> int:
    """The tiny ``head_dim``, doubled until each partial rotary (``data``: the user's config, as a dict) rotates
    a multiple of 4 dims of it where the full head's did: M-RoPE's two axes take frequencies in pairs of pairs
    (NeoMME rotates a quarter of its head, 2 dims of an 8-wide one, and validates it)."""
    full = data.get("head_dim")
    rope = data.get("rope_parameters") or {}
    kinds = [r for r in rope.values() if isinstance(r, dict)] or [rope]  # one rotary per kind of layer, or one
    factors = {r.get("partial_rotary_factor", data.get("partial_rotary_factor")) or 1.0 for r in kinds}
    if type(full) is not int:
        return head_dim
    while head_dim < full and any(int(full * f) % 4 == 0 and int(head_dim * f) % 4 for f in factors):
        head_dim *= 2
    return head_dim
