"""Tiny random models of any transformers architecture, from its default config scaled down.

For checks, not for training: two layers, four query heads over two key/value heads, a vocabulary
of 99 (odd: vocabulary padding is exercised), no dropout. Sizes that a config derives from others
(``head_dim``, ``layer_types``) are recomputed by the config itself where it can.
"""

from __future__ import annotations

VOCAB = 99
SIZES = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "sliding_window": 4,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_DROPOUT_WORDS = ("dropout", "pdrop", "drop_rate")


def tiny_config(config_class, **overrides):
    """``config_class`` with small sizes (only those it knows), every dropout 0, and ``overrides``."""
    defaults = config_class().to_dict()
    kwargs = {k: v for k, v in SIZES.items() if k in defaults}
    for key, value in defaults.items():
        if isinstance(value, float) and any(w in key for w in _DROPOUT_WORDS):
            kwargs[key] = 0.0
    if "layer_types" in defaults:
        kwargs["layer_types"] = None  # recomputed for num_hidden_layers
    kwargs.update(overrides)
    return config_class(**kwargs)
