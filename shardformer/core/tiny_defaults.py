"""What a config leaves unset that its model reads: filled as transformers' own configs fill it.

A checkpoint's config names every value its model reads; a class's default config may leave some None
for the checkpoint to set (LFM2-MoE's ``layer_types``, Dots1's expert counts, CohereCompass's RoPE), and then
builds no model. Such a default is no reason to leave the class untested: `complete_unset` fills what is
unset by the rules transformers' configs use where they derive it (every layer full attention, the first MLP
dense and the rest sparse, the default rotary), and counts of experts small enough for any copy. Values a
config sets are never changed.
"""

from __future__ import annotations

DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# per-layer schedules a config may leave None, as transformers' configs derive them: (first layer's, others')
SCHEDULES = {"layer_types": ("full_attention", "full_attention"), "mlp_layer_types": ("dense", "sparse")}
# MoE counts a config may leave None (DiffusionGemma's, Dots1's): experts chosen per token, experts
TOP_K, EXPERTS = 2, 4


def complete_unset(config) -> None:
    """Fill, in place, what ``config`` and each of its sub-configs leave unset that their models read."""
    for key, sub in list(config.to_dict().items()):
        if sub is None and key in getattr(config, "sub_configs", {}):  # a tower left unset: its class's defaults
            setattr(config, key, config.sub_configs[key]())
        elif isinstance(sub, dict) and "model_type" in sub:  # a sub-config (a dict read as one would not be)
            complete_unset(getattr(config, key))
    data = config.to_dict()
    depth = data.get("num_hidden_layers")
    for key, (first, rest) in SCHEDULES.items():
        if key in data and data[key] is None and isinstance(depth, int):
            setattr(config, key, [first, *[rest] * (depth - 1)][:depth])
    for name in (k for k, v in data.items() if v is None and k.endswith(("experts", "experts_per_tok"))):
        top_k = name.startswith("top_k") or name.endswith("per_tok")
        setattr(config, name, TOP_K if top_k else 1 if "shared" in name else EXPERTS)
    if data.get("moe_intermediate_size", 0) is None:
        config.moe_intermediate_size = data.get("intermediate_size")
    if isinstance(data.get("num_attention_heads"), int) and "num_key_value_heads" not in data:
        # read by the model, undeclared by its config (MoonshineStreaming's): transformers' default, one per head
        config.num_key_value_heads = data["num_attention_heads"]
    if "rope_parameters" in data and not data["rope_parameters"] and not data.get("rope_theta"):
        types = getattr(config, "layer_types", None)
        # one rotary per kind of layer where the config keys it so (CohereCompass), else one for all
        config.rope_parameters = {t: dict(DEFAULT_ROPE) for t in set(types)} if types else dict(DEFAULT_ROPE)


def fill_schedule(config, defaults: dict) -> None:
    """A tiny ``config`` whose ``layer_types`` the recipe unset for its class to recompute, and which it did not
    (LFM2-MoE's): every layer of the one kind the user's config (``defaults``, as a dict) had, or full attention."""
    depth, kinds = getattr(config, "num_hidden_layers", None), defaults.get("layer_types")
    if getattr(config, "layer_types", 1) is not None or not isinstance(depth, int) or not isinstance(kinds, list):
        return
    kinds = set(kinds)
    config.layer_types = [kinds.pop() if len(kinds) == 1 else "full_attention"] * depth
