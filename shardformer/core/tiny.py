"""The one recipe for tiny random models: any transformers architecture's default config scaled down.

Used by the family records (``gpt2-tiny``, ...), the conformance sweep and the tests. For checks,
not for training: two layers, four query heads over two key/value heads, a vocabulary
of 99 (odd: vocabulary padding is exercised), no dropout. Sizes that a config derives from others
(``head_dim``, ``layer_types``) are recomputed by the config itself where it can.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass

from shardformer.core import tiny_layers, tiny_timm, tiny_widths
from shardformer.core.tiny_choices import open_choices
from shardformer.core.tiny_defaults import fill_schedule
from shardformer.core.tiny_layers import depth_keys, depth_of, fit_hybrid, kept_layers, lacks_attention, layer_overrides
from shardformer.core.tiny_rotary import rotary_head_dim, rotary_sections
from shardformer.core.tiny_sequence import fit_training_sequence
from shardformer.core.tiny_vocab_map import fit_codebooks

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
    "n_group": 2,  # grouped routing (DeepSeek-V3): the 4 experts in 2 groups, the best group chosen
    "topk_group": 1,
    "zero_expert_num": 2,
    "q_lora_rank": 24,  # multi-head latent attention (ranks unlike any head width)
    "kv_lora_rank": 24,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 8,
    "sliding_window": 4,
    "num_query_tokens": 8,  # BLIP-2's learned queries: 4 video frames' worth (InstructBLIP-Video) fit 64 positions
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# schedules over the layers that two layers must still contain (one full-attention layer, no shared KV)
_FIT_TWO_LAYERS = {"full_attention_interval": 2, "num_kv_shared_layers": 0}
_MLA = {"head_dim": SIZES["qk_rope_head_dim"], "num_key_value_heads": SIZES["num_attention_heads"]}
# dropout, stochastic depth, SpecAugment's random masks (wav2vec2), routers' jitter noise (Switch, Mixtral):
# randomness a check must not see
_DROPOUT_WORDS = ("dropout", "pdrop", "drop_rate", "drop_path", "layerdrop", "stochastic_depth", "mask_time_prob")
_DROPOUT_WORDS += ("mask_feature_prob", "jitter")
# keys of a saved config that its class recomputes (or refuses as arguments)
_DERIVED = ("transformers_version", "architectures", "_name_or_path", "model_type", "dtype", "torch_dtype")


def tiny_config(config_class, base: dict | None = None, **overrides):
    """``config_class`` with small sizes (only those it knows), every dropout 0, and ``overrides``;
    ``base``: the values to start from (default: the class's defaults)."""
    defaults = config_class().to_dict() if base is None else base
    aliases = getattr(config_class, "attribute_map", {})  # GPT-2 spells hidden_size n_embd
    kwargs = {aliases.get(k, k): v for k, v in SIZES.items() if aliases.get(k, k) in defaults}
    for key, value in defaults.items():
        if isinstance(value, float) and any(w in key for w in _DROPOUT_WORDS):
            kwargs[key] = 0.0
    if defaults.get("classifier_dropout") is None:  # transformers' generic token-classification head: 0.1 unset
        kwargs["classifier_dropout"] = 0.0
    if "qk_rope_head_dim" in defaults:  # multi-head latent attention: no grouped heads, rotates head_dim
        kwargs.update({k: v for k, v in _MLA.items() if k in defaults})
    if "layer_types" in defaults and _settable(config_class, "layer_types"):
        kwargs["layer_types"] = None  # recomputed for num_hidden_layers
    kwargs.update({k: v for k, v in _FIT_TWO_LAYERS.items() if k in defaults})
    kwargs.update(overrides)
    config = config_class(**({k: v for k, v in base.items() if k not in _DERIVED} if base else {}) | kwargs)
    types = getattr(config, "layer_types", None)  # a schedule, not ResNet's class-level list of allowed kinds
    schedule = "layer_types" in defaults and "layer_types" not in overrides and _settable(config_class, "layer_types")
    if schedule and lacks_attention(types):
        kwargs["layer_types"] = [*types[:-1], "full_attention"]  # a cache-holding attention layer for generate
        config = config_class(**({k: v for k, v in base.items() if k not in _DERIVED} if base else {}) | kwargs)
    fill_schedule(config, defaults)  # a schedule unset for the class to recompute, which it did not (LFM2-MoE)
    return config


_ID_WORDS = ("token_id", "token_ids", "token_index", "patch_id")  # an image patch's placeholder: Molmo2's
_GENERAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
_GENERAL_IDS += ("sep_token_id", "cls_token_id")
_KV_HEADS = tiny_widths.KV_HEADS
_VISION = {
    "image_size": 32,
    "patch_size": 8,
    "tubelet_size": 8,
    "merge_kernel_size": 2,  # Kimi K2.5's patches merged 2 x 2, as its checkpoints do
    "rotary_dim": 4,
    "num_patches": 16,  # a count, not a width: a square grid a learned position table is reshaped to (Cosmos 3 Edge)
}  # 16 patches; rotation inside a head of 8
_POSITION_WORDS = ("position", "max_", "positions", "seq_len", "window")


def tiny_copy_config(config, tp: int = 2, heads: int | None = None, special: dict | None = None):
    """A small config of the same architecture as ``config`` (an instance, the user's): its own
    choices kept (layouts, flags, activations), its sizes scaled down, heads enough for ``tp`` ranks
    (``heads``: this many query heads instead, for layouts that group heads in fixed blocks).

    Sizes the recipe knows get its values; other widths are scaled like the hidden size (an ``ffn_dim`` of 4
    hidden stays 4 hidden); positions become 64; token ids stay inside the vocabulary; sub-configs (a vision and
    a text tower) are scaled alike; one layer of each kind is kept, two blocks per stage of a convnet
    (`.tiny_layers`); special tokens outside the vocabulary get distinct ids at its top (`_special_ids`).

    The first of `tiny_copy_configs` that the config class accepts; a config that builds is not yet a model
    that runs: `shardformer.core.tiny_run.runnable_tiny_config` tries them all.
    """
    return next(tiny_copy_configs(config, tp, heads, special))[1]


# gentler ways to scale a config down, tried in order when a tiny copy cannot be built or does not run
@dataclass(frozen=True)
class Scaling:
    recompute: bool = False  # sizes the config derives from others (defaults None or "auto") recomputed
    keep_depth: bool = False  # every layer (a schedule of layer indices two layers cannot hold)
    keep_widths: bool = False  # only depth, vocabulary, positions and experts scaled down

    def __str__(self) -> str:
        named = [n.replace("_", " ") for n in ("recompute", "keep_depth", "keep_widths") if getattr(self, n)]
        return ", ".join(named) or "scaled"


SCALINGS = (
    Scaling(),
    Scaling(recompute=True),
    Scaling(keep_depth=True),
    Scaling(recompute=True, keep_depth=True),
    Scaling(keep_widths=True),
    Scaling(keep_widths=True, keep_depth=True),
)


def tiny_copy_configs(config, tp: int = 2, heads: int | None = None, special: dict | None = None, refused=None):
    """``(scaling, config)`` for each of `SCALINGS` whose small config the config class accepts, in order
    (``refused``, a list: gets ``(scaling, error)`` of each it refuses); raises the first's error when none is."""
    special = _special_ids(config.to_dict()) if special is None else special
    errors, built = [] if refused is None else refused, False
    for scaling in SCALINGS:
        try:
            tiny = _scaled(config, tp, heads, special, scaling)
        except Exception as e:  # noqa: BLE001 - a config class refusing these sizes: the next scaling
            errors.append((scaling, e))
        else:
            built = True
            yield scaling, tiny
    if not built:
        raise errors[0][1]


def _scaled(config, tp, heads, special, scaling: Scaling):
    heads = heads or max(4, 2 * tp)
    sizes = dict(SIZES, num_attention_heads=heads, hidden_size=heads * SIZES["head_dim"])
    sizes["head_dim"] = rotary_head_dim(config.to_dict(), SIZES["head_dim"])
    sizes["intermediate_size"] = 2 * sizes["hidden_size"]
    if scaling.keep_widths:
        sizes = {k: v for k, v in sizes.items() if k in _COUNTS}
    data = config.to_dict()
    cls = type(config)
    aliases = getattr(cls, "attribute_map", {})
    settable = functools.partial(_settable, cls)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = _read(text, "hidden_size") or _read(text, "d_model")  # Perceiver names no hidden_size
    full_heads = _read(text, "num_attention_heads") or data.get("num_attention_heads")  # per layer: read raises
    out = {}
    for key, value in data.items():
        sub = _read(config, key)
        if hasattr(sub, "to_dict") and hasattr(sub, "model_type") and sub is not config:
            out[key] = _scaled(sub, tp, heads, special, scaling).to_dict()
        elif isinstance(value, float) and any(w in key for w in _DROPOUT_WORDS):
            out[key] = 0.0
        elif isinstance(value, dict) and isinstance(value.get("mrope_section"), list) and not scaling.keep_widths:
            out[key] = dict(value, mrope_section=rotary_sections(value["mrope_section"], _rotary_pairs(data, value)))
        elif key in _VISION and _int_list(value):  # [height, width] (InternVL), or one per stage (Florence 2)
            out[key] = [min(v, _VISION[key]) for v in value]
        elif key.endswith(_WIDTH_WORDS) and _int_list(value) and isinstance(hidden, int) and not scaling.keep_widths:
            widths = [max(SIZES["head_dim"], round(v * sizes["hidden_size"] / hidden)) for v in value]  # conv_dim
            # MLP widths by layer type (Ernie 4.5 VL's experts): whole blocks of 8, as the ranks split them
            out[key] = [-(-w // 8) * 8 for w in widths] if "intermediate" in key else widths
        elif not isinstance(value, int) or isinstance(value, bool):
            continue
        elif key.endswith("vocab_size") and value == data.get("vocab_size"):  # Marian's decoder_vocab_size
            out[key] = VOCAB
        elif key.endswith(_ID_WORDS):
            out[key] = value if 0 <= value < VOCAB else special.get(value, SIZES["eos_token_id"])
        elif key.endswith(("layers", "sparse_step")) and value > 2:  # a period of MoE layers (NLLB-MoE's 4) too
            out[key] = 2
        elif any(w in key for w in _POSITION_WORDS) and value > 64:
            out[key] = 64
        elif scaling.keep_widths:
            continue
        elif key.endswith("out_hidden_size"):  # a tower's output: the text's width
            out[key] = sizes["hidden_size"]
        elif key in _KV_HEADS:
            out[key] = heads if value == full_heads else min(value, tp)
        elif key.endswith("heads") and value == full_heads or key.endswith("attention_heads") and value > 1:
            out[key] = heads
        elif key.endswith("heads") and isinstance(full_heads, int) and heads < value < full_heads:
            # other head counts (LaraMini's linear-attention key heads) keep their ratio to the heads
            out[key] = max(1, value * heads // full_heads)
        elif key in _VISION:
            out[key] = min(value, _VISION[key])
        elif value == hidden and any(w in key for w in _WIDTH_WORDS):  # a pooler's, a projection's width
            out[key] = sizes["hidden_size"]
        elif value >= 128 and isinstance(hidden, int):
            width = max(SIZES["head_dim"], round(value * sizes["hidden_size"] / hidden))
            # a tower's own width (Qwen2-VL's vision embed_dim beside a wider hidden_size) holds heads too
            out[key] = width if width % heads == 0 else -(-width // (2 * heads)) * 2 * heads
    for key, value in sizes.items():
        name = aliases.get(key, key)
        if name in data and not key.endswith("_id") and name not in _KV_HEADS and _scalar(data[name]):
            if key.endswith("head_dim") and data[name] == 0:  # a part the head lacks (Glm5Next's NoPE: no rotary)
                value = 0
            out[name] = min(value, data[name]) if key in _TOP_K and type(data[name]) is int else value
    _keep_apart(out, data, hidden, out.get(aliases.get("hidden_size", "hidden_size")))
    tiny_widths.tie_to_others(out, data)
    fit_training_sequence(out, data)
    tiny_timm.tie_tokens_per_image(out, data)
    if not scaling.keep_widths:
        tiny_widths.fit_convnet(out, data)
        tiny_timm.fit_timm_tower(out, data, sizes["hidden_size"], heads)
    tiny_layers.fit_stages(out, data, hidden, scaling)
    if "head_dim" in out and data.get("head_dim") == data.get("qk_rope_head_dim") is not None:
        out["head_dim"] = out.get("qk_rope_head_dim", data["head_dim"])  # multi-head latent attention rotates head_dim
    if scaling.keep_widths:  # the recipe's own sizes (tiny_config's) give way to the user's widths
        for key in SIZES.keys() - _COUNTS:
            name = aliases.get(key, key)
            if name in data and not key.endswith("_id") and settable(name) and name not in out:
                out[name] = data[name]
    if "layer_types" in data and settable("layer_types"):
        out["layer_types"] = None
    parts = _depth_parts(data, aliases)
    if parts and not scaling.keep_depth:  # Dory's input, recurrent and output layers add up to the depth
        out.update(parts)
    count = sum(parts.values()) or None
    keep = None if scaling.keep_depth else kept_layers(data, aliases, settable, count, scaling.recompute)
    if keep is not None:
        out.update(layer_overrides(data, aliases, keep, settable, lambda d: tiny_widths.scale_override(d, sizes, data)))
    fit_hybrid(out, data)
    tiny_layers.fit_tower_indices(out, data)
    rope = out.get("rope_parameters", data.get("rope_parameters"))
    multimodal_rope = "mrope_section" in getattr(cls, "ignore_keys_at_rope_validation", ())
    if multimodal_rope and isinstance(rope, dict) and "rope_type" in rope and not scaling.keep_widths:
        # one flat set, not one per layer type; the model's default sections (Qwen2-VL's [16, 24, 24])
        # fit its full head only
        out["rope_parameters"] = {"mrope_section": rotary_sections([1, 2, 1], _rotary_pairs(data, rope))} | rope
    if data.get("is_encoder_decoder") and data.get("decoder_start_token_id") is None:
        # generation settings live apart from the config in transformers 5; the decoder's first token is still
        # read from the config (T5's _shift_right): the pad token, as T5's checkpoints say
        out["decoder_start_token_id"] = out.get("pad_token_id", data.get("pad_token_id")) or 0
    out.update({k: v for k, v in _FIT_TWO_LAYERS.items() if k in data})
    out.update(open_choices(data, out))
    fit_codebooks(out, data, VOCAB)
    base = {k: v for k, v in data.items() if settable(k)}
    if scaling.recompute:
        base = {k: v for k, v in base.items() if k in out or k not in _derived_fields(cls)}
    if scaling.keep_depth:
        depth = {k for k in data if k.endswith("layers") or k in _FIT_TWO_LAYERS or k in _LAYER_LISTS}
        out = out | {k: data[k] for k in depth if k in base}
    try:
        return tiny_config(cls, base=base, **out)
    except Exception:  # noqa: BLE001 - a per-layer schedule that two layers cannot hold: keep the depth
        if keep is not None or scaling.keep_depth:
            raise
        depth = {k for k in data if k.endswith("layers") or k in _FIT_TWO_LAYERS or k in _LAYER_LISTS}
        return tiny_config(cls, base=base, **(out | {k: data[k] for k in depth if k in base}))


_COUNTS = {
    "vocab_size",
    "num_hidden_layers",
    "num_layers",
    "max_position_embeddings",
    "num_local_experts",
    "num_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_topk",
    "zero_expert_num",
    "sliding_window",
}
_TOP_K = ("num_experts_per_tok", "moe_topk")  # top-1 routing (Llama 4's, ZAYA's) is a choice the copy keeps
_WIDTH_WORDS = ("size", "dim", "embd", "width", "d_model", "channels")
_LAYER_LISTS = ("layer_types", "per_layer_config")
# widths a model compares with its hidden size to decide whether it projects between them
_APART_WORDS = ("embedding_size", "emb_size", "embed_proj_dim", "hidden_size", "hidden_dim")


def _keep_apart(out: dict, data: dict, hidden, tiny_hidden) -> None:
    """A width the user's config sets apart from the hidden size stays apart from the copy's: ELECTRA
    projects an ``embedding_size`` unlike its ``hidden_size``, and a copy where the two met would have no
    projection (every verdict on it, about another model). Smaller stays smaller, larger larger."""
    if not isinstance(hidden, int) or not isinstance(tiny_hidden, int):
        return
    for key, value in data.items():
        kept = key not in out and key not in SIZES  # a width the recipe neither scaled nor set
        if kept and key.endswith(_APART_WORDS) and type(value) is int and value != hidden and value == tiny_hidden:
            out[key] = tiny_hidden // 2 if value < hidden else 2 * tiny_hidden


def _depth_parts(data: dict, aliases: dict) -> dict[str, int]:
    """Layer counts that add up to the depth (Dory's ``n_input_layers + n_recurrent_layers +
    n_output_layers``), each cut to at most two; empty when the config has none."""
    depth = depth_of(data, aliases)
    parts = {
        k: v
        for k, v in data.items()
        if k.endswith("layers") and k not in depth_keys(aliases) and isinstance(v, int) and not isinstance(v, bool)
    }
    if not depth or len(parts) < 2 or sum(parts.values()) != depth:
        return {}
    return {k: min(v, 2) for k, v in parts.items()}


def _read(config, key):
    """``config.key``, or None (a per-layer attribute of a heterogeneous config raises on a global read)."""
    try:
        return getattr(config, key, None)
    except Exception:  # noqa: BLE001
        return None


def _int_list(value) -> bool:  # widths by layer (wav2vec2's feature encoder: conv_dim, seven of 512)
    return isinstance(value, list) and all(type(v) is int for v in value)


def _scalar(value) -> bool:
    return value is None or isinstance(value, (int, float)) and not isinstance(value, bool)


def _settable(cls, key: str) -> bool:
    """Whether ``cls(key=...)`` sets ``key``: not a read-only property (Mamba's ``layer_types``,
    FalconH1's ``layers_block_type`` behind its ``layer_types`` alias)."""
    name = getattr(cls, "attribute_map", {}).get(key, key)
    found = inspect.getattr_static(cls, name, None)
    return not isinstance(found, property) or found.fset is not None


def _derived_fields(cls) -> set[str]:
    """Fields the config computes from others when not given (declared default None or "auto")."""
    if not dataclasses.is_dataclass(cls):
        return set()
    return {f.name for f in dataclasses.fields(cls) if f.default is None or f.default == "auto"}


def _is_special(key, value) -> bool:
    special = isinstance(key, str) and key.endswith(_ID_WORDS) and key.lstrip("_") not in _GENERAL_IDS
    return special and isinstance(value, int) and not isinstance(value, bool)


def _special_ids(data: dict) -> dict[int, int]:
    """Out-of-vocabulary ids of special tokens other than bos/eos/pad (an image, a video, a
    vision-start token), anywhere in the nested config, mapped to distinct ids at the top of the tiny
    vocabulary: a model that tells its image placeholder from its vision-start token must see two."""
    found: set[int] = set()

    def walk(d: dict) -> None:
        for key, value in d.items():
            if isinstance(value, dict):
                walk(value)
            elif _is_special(key, value) and not 0 <= value < VOCAB:
                found.add(value)

    walk(data)
    return {value: VOCAB - 1 - i for i, value in enumerate(sorted(found))}


def _rotary_pairs(data: dict, rope: dict) -> int:
    """Rotated pairs in a tiny head (fewer with a partial rotary factor; latent attention rotates its
    ``qk_rope_head_dim`` part only: HYV4VL's)."""
    factor = rope.get("partial_rotary_factor", data.get("partial_rotary_factor", 1.0)) or 1.0
    width = SIZES["qk_rope_head_dim"] if data.get("qk_rope_head_dim") else SIZES["head_dim"]
    return max(1, int(width * factor) // 2)


def fill_zero_matrices(model, std: float = 0.02) -> None:
    """Random values in every matrix a model initialises to zero or below 1e-6 (Gemma 3's image projector,
    BLIP-2's query tokens; BLIP's 1e-10 vision tower, where any cut matched to 1e-25): on a tiny copy
    it makes what follows zero or degenerate (a norm of zeros turns rounding into huge gradients)."""
    import torch

    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1 and param.is_floating_point() and not param.abs().max() > 1e-6:
                param.normal_(0, std)
