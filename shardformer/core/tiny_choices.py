"""Config values a tiny copy sets beyond the sizes: choices a config leaves open that the forward needs
made, ids a model reads with defaults its config does not hold, image grids and image-token counts that
fit the tiny image.

A full model may run with a choice unmade where its user makes it at run time (X-MOD's language:
``set_default_language``), or read a token id through ``getattr(config, key, default)`` with a default
that fits the full vocabulary only (ShieldGemma 2's yes/no tokens). A tiny copy of 99 tokens makes
those choices itself, the first that the config offers, so that its forward runs as the full one does.
LLaVA-NeXT tiles an image by the best of its ``image_grid_pinpoints`` (pixel sizes, multiples of its
vision tower's ``image_size``): a tiny tower's tiles are smaller, and so are the grids.
"""

from __future__ import annotations

# model type -> token ids its model reads with a default outside its config (a full vocabulary's ids)
IDS_READ_WITH_DEFAULTS = {"shieldgemma2": ("yes_token_index", "no_token_index")}
FIRST_ORDINARY_ID = 3  # after pad, bos and eos (`shardformer.core.tiny.SIZES`)


def open_choices(data: dict, scaled: dict) -> dict:
    """The values a tiny copy of the config ``data`` (its sizes ``scaled`` so far) sets beyond them."""
    out = {}
    grid = data.get("image_grid_pinpoints")
    full, tiny = ((d.get("vision_config") or {}).get("image_size") for d in (data, scaled))
    if grid and isinstance(full, int) and isinstance(tiny, int):
        # tiles of the tiny tower, as many as the full one's (rounded: Granite 4 Vision's default pinpoints are
        # multiples of 336, its default CLIP tower's tiles 224)
        out["image_grid_pinpoints"] = [[max(1, round(side / full)) * tiny for side in pinpoint] for pinpoint in grid]
    tokens, vision = data.get("mm_tokens_per_image"), scaled.get("vision_config") or {}
    image, patch = _square(vision.get("image_size")), _square(vision.get("patch_size"))
    per_side = image // patch if image and patch else 0
    if isinstance(tokens, int) and round(tokens**0.5) ** 2 == tokens and per_side:
        # Gemma 3 pools its patches to a square of image tokens whose side divides the patches' side
        most = scaled.get("mm_tokens_per_image", tokens)
        side = max(s for s in range(1, per_side + 1) if per_side % s == 0 and s * s <= max(most, 1))
        out["mm_tokens_per_image"] = side * side
    rate, side = data.get("downsample_rate"), per_side
    if isinstance(rate, str) and rate.count("/") == 1 and all(p.isdigit() for p in rate.split("/")) and side:
        # Granite 4 Vision's Q-Former: queries of a side "q/w" of each window's, windows of w x w patches: windows
        # that fit the tiny tower's grid of patches, in the same ratio
        query, window = map(int, rate.split("/"))
        if window > side or side % window:
            fit = max((w for w in range(1, side + 1) if side % w == 0 and w * query % window == 0), default=None)
            if fit is not None:
                out["downsample_rate"] = f"{fit * query // window}/{fit}"
    languages = data.get("languages")
    if "default_language" in data and data["default_language"] is None and languages:
        out["default_language"] = list(languages)[0]  # X-MOD: adapters per language, none chosen
    for i, key in enumerate(IDS_READ_WITH_DEFAULTS.get(data.get("model_type"), ())):
        out[key] = FIRST_ORDINARY_ID + i  # distinct ids inside the tiny vocabulary
    return out


def _square(size) -> int | None:
    """The side of an image or patch size given as one int or as equal ``[height, width]``; None for a
    rectangle or a size per stage (Florence 2's patch sizes, one per convolution stage)."""
    if type(size) is int:
        return size
    if isinstance(size, (list, tuple)) and len(size) == 2 and type(size[0]) is int and size[0] == size[1]:
        return size[0]
    return None
