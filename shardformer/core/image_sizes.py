"""Images whose pixel sizes or tiles a model reads besides the pixels: LLaVA-NeXT's tiles by its grid pinpoints,
Pixtral's and Apertus 1.5's sizes, Mllama's tiles (the inputs' recipe: `shardformer.core.inputs`)."""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn


def tiled_images(vision, pixels: torch.Tensor, tokens: tuple[int, int]) -> dict:
    """Mllama's processor's output for one picture per sample that fits one tile (aspect ratio 1 x 1, id 1):
    ``[batch, images, tiles, ...]`` pixels with the unused tiles masked, and every text token seeing the
    image's tile."""
    tiles = vision.max_num_tiles
    used = torch.zeros(tokens[0], 1, tiles, dtype=torch.long)
    used[..., 0] = 1
    return {
        "pixel_values": torch.cat(
            [pixels[:, None, None], pixels[:, None, None].expand(-1, -1, tiles - 1, -1, -1, -1)], 2
        ),
        "aspect_ratio_ids": torch.ones(tokens[0], 1, dtype=torch.long),
        "aspect_ratio_mask": used,
        "cross_attention_mask": used[:, None].expand(-1, tokens[1], -1, -1).clone(),
    }


def takes_sizes(model: nn.Module, vision) -> bool:
    """Whether the vision tower (a module built from ``vision``, the vision config) reads the pixel sizes
    itself (Pixtral), or the model's ``get_image_features`` requires them (Apertus 1.5 tokenizes each image at
    its own size); a CLIP tower under a forward that also offers ``image_sizes`` (LLaVA) does not."""
    features = next((m.get_image_features for m in model.modules() if hasattr(m, "get_image_features")), None)
    sizes = inspect.signature(features).parameters.get("image_sizes") if features is not None else None
    return (sizes is not None and sizes.default is sizes.empty) or any(
        module is not model and getattr(module, "config", None) is vision and "image_sizes" in _params(module)
        for module in model.modules()
    )


def _params(module: nn.Module):
    return inspect.signature(module.forward).parameters


def sized_images(config, channels: int, side: int, batch: int, g: torch.Generator) -> dict:
    """Images with their pixel sizes (``image_sizes``): one ``side``-square picture each (Pixtral), or,
    where the config tiles images by ``image_grid_pinpoints`` (LLaVA-NeXT), one as large as the first
    grid, cut into its tiles after the whole picture scaled down, as LLaVA-NeXT's processor does."""
    grid = getattr(config, "image_grid_pinpoints", None)
    height, width = grid[0] if grid else (side, side)
    sizes = torch.tensor([[height, width]] * batch)
    if not grid:
        return {"pixel_values": torch.randn(batch, channels, side, side, generator=g), "image_sizes": sizes}
    tiles = 1 + (height // side) * (width // side)
    return {"pixel_values": torch.randn(batch, tiles, channels, side, side, generator=g), "image_sizes": sizes}
