"""Inputs a forward requires beside its token ids, as the model's own processor makes them: a box per
token of a document model, the regions of an image that LXMERT reads as features, a robot policy's state
and the draws of its flow-matching loss."""

from __future__ import annotations

import torch

REGIONS = 4  # image regions of a region-feature model (LXMERT), as a few tokens are text


def side_inputs(config, params, tokens: tuple[int, int], g: torch.Generator) -> dict:
    """The inputs ``params`` (a forward's parameters) require beside token ids of shape ``tokens``."""
    out = {}
    if "bbox" in params and getattr(config, "dim_bbox", 4) in (4, 8):
        out["bbox"] = boxes(config, tokens, g)
    feat, pos = getattr(config, "visual_feat_dim", None), getattr(config, "visual_pos_dim", None)
    if "visual_feats" in params and isinstance(feat, int) and isinstance(pos, int):
        out["visual_feats"] = torch.randn(tokens[0], REGIONS, feat, generator=g)
        out["visual_pos"] = torch.rand(tokens[0], REGIONS, pos, generator=g)  # normalised box corners
    state, actions = getattr(config, "max_state_dim", None), getattr(config, "max_action_dim", None)
    if "state" in params and isinstance(state, int) and isinstance(actions, int):
        out.update(_policy_inputs(config, tokens[0], state, actions, g))
    return out


def _policy_inputs(config, batch: int, state: int, actions: int, g: torch.Generator) -> dict:
    """PI0's robot state and target actions, with the noise and timestep its forward would draw itself
    when not given (drawn here: the sharded and unsharded copies must see the same)."""
    steps = (batch, config.chunk_size, actions)
    return {
        "state": torch.randn(batch, state, generator=g),
        "actions": torch.randn(*steps, generator=g),
        "noise": torch.randn(*steps, generator=g),
        "timestep": torch.rand(batch, generator=g),
    }


def boxes(config, tokens: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    """One box ``[x0, y0, x1, y1]`` per token, its corners ordered: integer coordinates below the
    config's ``max_2d_position_embeddings`` where the model embeds each (LayoutLM), else normalised to
    [0, 1] (Bros, which scales them by its ``bbox_scale``)."""
    limit = getattr(config, "max_2d_position_embeddings", None)
    if isinstance(limit, int):
        corners = torch.randint(0, limit, (*tokens, 2, 2), generator=g)
    else:
        corners = torch.rand(*tokens, 2, 2, generator=g)
    return corners.sort(dim=-2).values.reshape(*tokens, 4)  # (x0, y0) <= (x1, y1) coordinate-wise
