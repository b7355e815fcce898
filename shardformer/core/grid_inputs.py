"""Images as patches with their grid (Qwen2-VL's ``image_grid_thw``): the rows a processor gives a vision tower
that reads a picture as a list of patches, in the layout the model's processor uses."""

from __future__ import annotations

import torch

# model type (the model's, or its vision tower's) -> the shape its processor gives the patches of a grid in (Kimi
# K2.5: a picture per patch; Inkling 2: a channels-last picture per merged patch), other than one patch per row
PATCH_LAYOUTS = dict.fromkeys(("kimi_k25", "paddleocr_vl"), lambda channels, side, merge: (-1, channels, side, side))
PATCH_LAYOUTS["inkling2_vision"] = lambda channels, side, merge: (-1, side * merge, side * merge, channels)
# vision towers whose grid counts merged patches (the language model's image tokens), not patches (Inkling 2's)
GRIDS_IN_TOKENS = {"inkling2_vision"}


def grid_images(vision, model_type, params, grid_key: str, channels: int, batch: int, g: torch.Generator) -> dict:
    """``batch`` images of a 2×2 grid of merged patches each, with their grid under ``grid_key`` (``image_grid_thw``,
    or NemotronH Omni's ``image_grid_hw``: no time axis); ``params``: the forward's parameters."""
    kernel = getattr(vision, "merge_kernel_size", None)  # Kimi K2.5: [height, width]
    # MuseGlimmer names the merge and the temporal patch its own way
    merge = getattr(vision, "spatial_merge_size", None) or getattr(vision, "merge_size", None)
    merge = merge or (kernel[0] if isinstance(kernel, (list, tuple)) else 1)
    side = 2 * merge
    frames = getattr(vision, "temporal_patch_size", None) or getattr(vision, "patch_temporal", 1)
    patch = vision.patch_size * vision.patch_size * frames
    counted = side // merge if getattr(vision, "model_type", None) in GRIDS_IN_TOKENS else side
    grid = {
        "pixel_values": torch.randn(batch * side * side, channels * patch, generator=g),
        grid_key: torch.tensor([[1, counted, counted] if grid_key.endswith("thw") else [counted, counted]] * batch),
    }
    if "image_merge_sizes" in params:  # VideoLLaMA 3: each image's merge, given with its grid
        grid["image_merge_sizes"] = torch.tensor([merge] * batch)
    layout = PATCH_LAYOUTS.get(model_type) or PATCH_LAYOUTS.get(getattr(vision, "model_type", None))
    if layout is not None:
        grid["pixel_values"] = grid["pixel_values"].reshape(layout(channels, vision.patch_size, merge))
    return grid


# vision towers whose processor gives each image as patches that are clips of its frames, channels last (Inkling:
# [patches, temporal_patch_size, patch_size, patch_size, channels], the picture repeated over the frames)
FRAMED_PATCHES = {"inkling_vision"}


def framed_patches(vision, channels: int, batch: int, g: torch.Generator, patches: int = 4) -> dict:
    """``batch`` images of ``patches`` patches each, every patch a clip of the tower's ``temporal_patch_size``
    frames, channels last; its tower gives one feature per patch."""
    side, frames = vision.patch_size, vision.temporal_patch_size
    return {"pixel_values": torch.randn(batch * patches, frames, side, side, channels, generator=g)}


def pooled_patches(vision, channels: int, batch: int, g: torch.Generator, pool: int = 4) -> dict:
    """Molmo2's processor's images: one crop per image of the tower's ``num_position_embeddings`` flattened
    patches (its count is fixed), every ``pool`` consecutive patches pooled into one image token
    (``image_token_pooling``: indices into all crops' patches), each image's tokens as a grid (``image_grids``:
    rows and columns of its tokens, no second, low-resolution grid)."""
    patches = vision.num_position_embeddings
    tokens = patches // pool
    side = int(tokens**0.5)
    return {
        "pixel_values": torch.randn(batch, patches, channels * vision.patch_size**2, generator=g),
        "image_token_pooling": torch.arange(batch * side * side * pool).reshape(-1, pool),
        "image_grids": torch.tensor([[side, side, 0, 0]] * batch),
    }
