"""The tiny copy's weights where its class's own initialisation leaves them degenerate.

A tiny copy is built from a config, so its weights are the class's initialisation, not a checkpoint's:
some draw matrices or norm scales at (or near) zero, which a trained model never has, and the proof on
such a copy compares zeros or rounding.
"""

from __future__ import annotations


def fill_zero_matrices(model, std: float = 0.02) -> None:
    """Random values in every matrix a model initialises to zero or below 1e-6 (Gemma 3's image projector,
    BLIP-2's query tokens; BLIP's 1e-10 vision tower, where any cut matched to 1e-25), ones in norm scales
    it draws near zero (EfficientNet's at std 0.02: through dozens, every gradient fell below 1e-7): on a tiny
    copy they make what follows zero or degenerate (a norm of zeros turns rounding into huge gradients)."""
    import torch

    norms = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.GroupNorm, torch.nn.LayerNorm)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1 and param.is_floating_point() and not param.abs().max() > 1e-6:
                param.normal_(0, std)
        for norm in (m for m in model.modules() if isinstance(m, norms) and m.weight is not None):
            if not norm.weight.abs().max() > 0.1:
                norm.weight.fill_(1.0)
