"""The model's config as a checkpoint records it, and the differences that make a checkpoint not fit.

Two models can have the same tensor shapes and still mean different things (4 heads of 8 or 2 of
16), so a training checkpoint records the config and loading compares it. Settings that only change
how the model runs, not what its weights mean (dropout, attention kernel, dtype, outputs), may differ.
"""

from __future__ import annotations

import json

import torch.nn as nn

_RUNTIME = {
    "_name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype", "_attn_implementation",
    "_attn_implementation_autoset", "attn_implementation", "_commit_hash", "use_cache", "output_attentions",
    "output_hidden_states", "return_dict", "_experts_implementation",
}  # fmt: skip


def config_of(model: nn.Module) -> dict | None:
    """The model's HuggingFace config as plain JSON data (None for a model without one, e.g. timm)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return None
    return json.loads(config.to_json_string(use_diff=False))


def _runtime_only(key: str) -> bool:
    return key in _RUNTIME or "dropout" in key or "pdrop" in key


def config_differences(saved: dict | None, current: dict | None) -> list[str]:
    """One line per setting that differs (settings that only change how the model runs are ignored)."""
    if saved is None or current is None:
        return []
    keys = sorted(k for k in set(saved) | set(current) if not _runtime_only(k))
    missing = object()
    return [
        f"config {k}: {saved.get(k, '(unset)')!r} in the checkpoint, {current.get(k, '(unset)')!r} here"
        for k in keys
        if saved.get(k, missing) != current.get(k, missing)
    ]
