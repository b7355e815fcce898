"""A timm vision tower inside a transformers config (``architecture`` and ``model_args``), scaled down by the
timm model's own arguments.

The config builds the tower with ``timm.create_model(architecture, **model_args)``: its widths and depth are
the architecture's unless ``model_args`` overrides them (Perception LM's ``embed_dim``, ``depth``, ``img_size``).
A tiny copy passes the same kinds of argument, smaller: the arguments the architecture's model class is built
with are read (its entry point's, under the config's), and those timm's classes share scaled: a depth
(``depth``; ``layers`` per stage, two blocks each), widths (``embed_dim``, with `shardformer.core.tiny`'s heads;
``embed_dims`` per stage, the widest `STAGE_WIDTH`), a width multiplier (``channel_multiplier``), the image
(``img_size``, `GRID` patches a side). The config's width of the tower's output (FastVLM's ``hidden_size``,
3072) becomes the tiny tower's ``num_features``.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

STAGE_WIDTH = 128  # the widest stage of a tiny convnet tower (FastViT's attention stages: heads 32 wide)
GRID = 4  # patches a side of a tiny ViT tower's image
MULTIPLIER = 1 / 16  # of a MobileNet's channels
_DEPTHS = ("depth", "layers", "depths")
_WIDTH_KEYS = ("hidden_size",)


def fit_timm_tower(out: dict, data: dict, hidden: int, heads: int) -> None:
    """In ``out`` (the copy's values of the sub-config ``data``): ``model_args`` scaled down, and the output
    width the config states (``hidden_size``) that of the tiny tower; nothing where timm cannot build it."""
    architecture, given = data.get("architecture"), data.get("model_args") or {}
    if not isinstance(architecture, str) or not isinstance(given, dict):
        return
    try:
        full, args = _built_with(architecture, given)
        tiny = dict(given) | _scaled_args(type(full), args, hidden, heads)
        full_width, width = full.num_features, _meta_model(architecture, tiny).num_features
    except Exception:  # noqa: BLE001 - not a timm architecture (or timm absent): the config's values as scaled
        return
    out["model_args"] = tiny
    for key in _WIDTH_KEYS:
        if data.get(key) == full_width:  # the tower's output, as the projector after it reads it
            out[key] = width


def tie_tokens_per_image(out: dict, data: dict) -> None:
    """A count of image tokens (Gemma 3n's ``vision_soft_tokens_per_image``, 256) that is a timm tower's output
    grid (16 x 16): the tiny tower's."""
    for key, sub in data.items():
        tiny = out.get(key)
        if (
            not isinstance(sub, dict)
            or not isinstance(tiny, dict)
            or "msfa_output_resolution" not in (tiny.get("model_args") or {})
        ):
            continue
        full = (sub.get("model_args") or {}).get("msfa_output_resolution", 16)
        side = tiny["model_args"]["msfa_output_resolution"]
        for name, value in data.items():
            if name.endswith("tokens_per_image") and value == full * full:
                out[name] = side * side


def _scaled_args(model_class, args: dict, hidden: int, heads: int) -> dict:
    takes = inspect.signature(model_class).parameters
    out = {}
    for key, value in args.items():
        if key in _DEPTHS and type(value) is int:
            out[key] = min(value, 2)
        elif key in _DEPTHS and _ints(value):
            out[key] = tuple(min(v, 2) for v in value)  # two blocks show a stage's per-block rule twice
        elif key == "embed_dim" and type(value) is int and value > hidden:
            out[key] = hidden
            if "num_heads" in takes:
                out["num_heads"] = heads
        elif key == "embed_dims" and _ints(value) and max(value) > STAGE_WIDTH:
            out[key] = tuple(max(8, round(v * STAGE_WIDTH / max(value) / 8) * 8) for v in value)
    resolution = takes.get("msfa_output_resolution")  # MobileNet-V5's output grid, a side (16: 256 tokens)
    if resolution is not None and args.get("msfa_output_resolution", resolution.default) > GRID:
        out["msfa_output_resolution"] = GRID
    if "block_args" in takes:  # an EfficientNet / MobileNet: its entry point's generator takes a width multiplier
        out["channel_multiplier"] = args.get("channel_multiplier", 1.0) * MULTIPLIER
    size, patch = args.get("img_size"), _patch(args)
    if size is not None and patch:
        out["img_size"] = (GRID * patch, GRID * patch)
        if "ref_feat_shape" in args:  # a rotary laid over the patch grid (PE's)
            out["ref_feat_shape"] = (GRID, GRID)
    return out


def _patch(args: dict) -> int | None:
    patch = args.get("patch_size")
    return patch[0] if isinstance(patch, (tuple, list)) else patch


def _built_with(architecture: str, given: dict) -> tuple[torch.nn.Module, dict]:
    """The model ``architecture`` builds with ``given`` (on the meta device) and the arguments its entry point
    passes the model's class."""
    model = _meta_model(architecture, given)
    model_class = type(model)
    seen: dict = {}
    original = model_class.__init__

    def recording(self, *args, **kwargs):
        seen.update(kwargs)
        original(self, *args, **kwargs)

    model_class.__init__ = recording  # for one meta build: entry points pass their arguments nowhere else
    try:
        _meta_model(architecture, given)
    finally:
        model_class.__init__ = original
    return model, seen


def _meta_model(architecture: str, args: dict):
    import timm  # slow to import: only for a config that names a timm architecture

    with torch.device("meta"), contextlib.redirect_stdout(None):
        return timm.create_model(architecture, pretrained=False, **args)


def _ints(value) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(type(v) is int for v in value)
