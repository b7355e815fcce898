"""The one recipe for tiny random models: any transformers architecture's default config scaled down.

Used by the family records (``gpt2-tiny``, ...), the conformance sweep and the tests. For checks,
not for training: two layers, four query heads over two key/value heads, a vocabulary
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
    "num_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "num_local_experts": 4,  # mixture of experts
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "ffn_hidden_size": 64,
    "expert_ffn_hidden_size": 32,
    "moe_topk": 2,
    "zero_expert_num": 2,
    "q_lora_rank": 24,  # multi-head latent attention (ranks unlike any head width)
    "kv_lora_rank": 24,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 8,
    "sliding_window": 4,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# schedules over the layers that two layers must still contain (one full-attention layer, no shared KV)
_FIT_TWO_LAYERS = {"full_attention_interval": 2, "num_kv_shared_layers": 0}
_MLA = {"head_dim": SIZES["qk_rope_head_dim"], "num_key_value_heads": SIZES["num_attention_heads"]}
_DROPOUT_WORDS = ("dropout", "pdrop", "drop_rate")


def tiny_config(config_class, **overrides):
    """``config_class`` with small sizes (only those it knows), every dropout 0, and ``overrides``."""
    defaults = config_class().to_dict()
    aliases = getattr(config_class, "attribute_map", {})  # GPT-2 spells hidden_size n_embd
    kwargs = {aliases.get(k, k): v for k, v in SIZES.items() if aliases.get(k, k) in defaults}
    for key, value in defaults.items():
        if isinstance(value, float) and any(w in key for w in _DROPOUT_WORDS):
            kwargs[key] = 0.0
    if "qk_rope_head_dim" in defaults:  # multi-head latent attention: no grouped heads, rotates head_dim
        kwargs.update({k: v for k, v in _MLA.items() if k in defaults})
    if "layer_types" in defaults:
        kwargs["layer_types"] = None  # recomputed for num_hidden_layers
    for key, value in _FIT_TWO_LAYERS.items():
        if key in defaults:
            kwargs[key] = value
    kwargs.update(overrides)
    config = config_class(**kwargs)
    types = getattr(config, "layer_types", None)
    if "layer_types" not in overrides and isinstance(types, list) and types and "full_attention" not in types:
        kwargs["layer_types"] = [*types[:-1], "full_attention"]  # a cache-holding attention layer for generate
        config = config_class(**kwargs)
    return config
