"""Widths a config ties to another config's: a scaled copy keeps the tie, or the model it builds does not run."""

from __future__ import annotations

import math

KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")


def tie_to_others(out: dict, data: dict) -> None:
    """Each tie below that ``data`` (the user's config, as a dict) holds, kept in ``out`` (the copy's values)."""
    ties = (tie_merged_width, tie_projection_to_channels, tie_shuffled_width, tie_patch_queries, tie_vision_width)
    ties += (tie_groups, tie_projection_to_text, tie_channels_to_sibling, tie_adapter_to_text)
    ties += (tie_used_vocab, tie_sibling_width, tie_codebook_vocab, tie_samples_to_hop, tie_heads_of_64)
    for tie in ties:
        tie(out, data)


def tie_merged_width(out: dict, data: dict) -> None:
    """A projector fed the vision tower's patches merged ``merge_size x merge_size`` (MuseGlimmer's
    ``out_hidden_size``, 4 x the tower's width): the copy's width is the copy's tower's, merged alike."""
    vision, tiny = data.get("vision_config"), out.get("vision_config")
    if not isinstance(vision, dict) or not isinstance(tiny, dict) or not isinstance(data.get("out_hidden_size"), int):
        return
    merge = vision.get("merge_size")
    if isinstance(merge, int) and data["out_hidden_size"] == vision.get("hidden_size", 0) * merge * merge:
        out["out_hidden_size"] = tiny.get("hidden_size", vision["hidden_size"]) * merge * merge


def tie_projection_to_channels(out: dict, data: dict) -> None:
    """A shared embedding width that is the vision convnet's last channels, unprojected (ALIGN's
    ``projection_dim``: EfficientNet's last ``out_channels`` times its ``width_coefficient``): the copy's
    width is the copy's tower's."""
    vision, tiny = data.get("vision_config"), out.get("vision_config")
    if not isinstance(vision, dict) or not isinstance(tiny, dict) or not isinstance(data.get("projection_dim"), int):
        return
    channels, coefficient = vision.get("out_channels"), vision.get("width_coefficient")
    if isinstance(channels, list) and channels and data["projection_dim"] == round(channels[-1] * (coefficient or 1)):
        out["projection_dim"] = round(tiny["out_channels"][-1] * (tiny.get("width_coefficient") or 1))


def tie_shuffled_width(out: dict, data: dict) -> None:
    """A vision adapter that pixel-shuffles patches by ``pixel_shuffle_ratio`` then reads them with a layer
    of ``intermediate_size`` inputs (Llama 4's: the hidden size over the ratio squared): the copy keeps the
    tie at its own hidden size."""
    ratio, hidden, tiny = data.get("pixel_shuffle_ratio"), data.get("hidden_size"), out.get("hidden_size")
    widths = isinstance(ratio, float) and isinstance(hidden, int) and isinstance(tiny, int)
    if widths and data.get("intermediate_size") == hidden / ratio**2:
        out["intermediate_size"] = round(tiny / ratio**2)


def tie_patch_queries(out: dict, data: dict) -> None:
    """A projector that picks its number of queries by the image's number of patches (Aria's
    ``projector_patch_to_query_dict``, for 490- and 980-pixel images): one entry, for the copy's image, with
    at most as many queries as patches."""
    tiny = out.get("vision_config")
    key = next((k for k, v in data.items() if k.endswith("patch_to_query_dict") and isinstance(v, dict) and v), None)
    if key is None or not isinstance(tiny, dict) or not tiny.get("image_size") or not tiny.get("patch_size"):
        return
    patches = (tiny["image_size"] // tiny["patch_size"]) ** 2
    out[key] = {patches: min(min(int(q) for q in data[key].values()), patches)}


def tie_vision_width(out: dict, data: dict) -> None:
    """A width of the top config that is the vision tower's, unlike the text's (Kimi K2.5's
    ``projection_hidden_size``, the norm over the tower's features): the copy's tower's."""
    vision, tiny = data.get("vision_config"), out.get("vision_config")
    if not isinstance(vision, dict) or not isinstance(tiny, dict) or not isinstance(vision.get("hidden_size"), int):
        return
    text = (data.get("text_config") or {}).get("hidden_size", data.get("hidden_size"))
    for key, value in data.items():
        if key.endswith("_hidden_size") and value == vision["hidden_size"] != text:
            out[key] = tiny["hidden_size"]


def tie_adapter_to_text(out: dict, data: dict) -> None:
    """An adapter's width that is the text's hidden size, or a half or a quarter of it (Dots3 Note's
    ``adapter_out_dim``, FunASR-Nano's ``adaptor_config.intermediate_size``, both validated): the copy's text's,
    in the same ratio; a sub-config's ``text_hidden_size``, the copy's text width by its name. Adapters only: a tower's own widths are scaled as its own."""
    text, tiny = (data.get("text_config") or {}).get("hidden_size"), (out.get("text_config") or {}).get("hidden_size")
    if type(text) is not int or type(tiny) is not int:
        return
    for name, sub in data.items():
        if not isinstance(sub, dict) or name == "text_config" or not isinstance(out.get(name), dict):
            continue
        for key, value in ((k, v) for k, v in sub.items() if isinstance(k, str)):  # not id2label's ints
            # an adapter's input, its tower's own width, stays the tower's
            adapter = ("adapt" in name or key.startswith("adapter")) and value != sub.get("hidden_size")
            ratio = next((k for k in (1, 2, 4) if type(value) is int and value * k == text), None)
            if adapter and ratio is not None and key.endswith(_WIDTHS + ("_size",)):
                out[name][key] = tiny // ratio
            elif key == "text_hidden_size" and type(value) is int:  # by its name (Molmo2's adapter: 3584 of 4096)
                out[name][key] = tiny


def tie_groups(out: dict, data: dict) -> None:
    """A group count (a GroupNorm's: WavTokenizer's ``decoder_attention_num_groups``, 32) dividing widths of the
    user's config that the copy scaled to sizes it does not divide: the most groups that divide them all."""
    for key, groups in data.items():
        if not key.endswith("num_groups") or type(groups) is not int or groups < 2 or key in out:
            continue
        widths = [w for k, w in out.items() if k.endswith(_WIDTHS) and _divides(groups, data.get(k)) and type(w) is int]
        if any(w % groups for w in widths):
            out[key] = math.gcd(groups, *widths)


TINY_RESOLUTION = 32  # a VQ-VAE's image side (`shardformer.core.tiny`'s image_size)
FIXED_GROUPS = 32  # the GroupNorm of the VQ-VAE convnets (Chameleon's, Emu3's, Janus's): in their code, not config


def fit_convnet(out: dict, data: dict) -> None:
    """A VQ-VAE's ``resolution`` (its image side) at `TINY_RESOLUTION`, its ``attn_resolutions`` scaled alike.
    A convnet's ``base_channels`` (the VQ-VAEs': each stage a multiple of it) that is a multiple of
    `FIXED_GROUPS` in the user's config: the copy's is `FIXED_GROUPS`, the fewest its norms take (8 channels in
    32 groups fail). A width that is its deepest stage's (Emu3's VQ attention ``hidden_size``: base times the last
    multiplier) stays that stage's."""
    resolution, attention = data.get("resolution"), data.get("attn_resolutions")
    if type(resolution) is int and resolution > TINY_RESOLUTION:  # the image it was built for, and where it attends
        out["resolution"] = TINY_RESOLUTION
        if _int_list(attention):
            out["attn_resolutions"] = [max(1, r * TINY_RESOLUTION // resolution) for r in attention]
    base = data.get("base_channels")
    if type(base) is not int or base % FIXED_GROUPS:
        return
    out["base_channels"] = FIXED_GROUPS
    last = (data.get("channel_multiplier") or [1])[-1]
    for key, value in data.items():
        if key.endswith(_WIDTHS) and key != "base_channels" and type(value) is int and value == base * last:
            out[key] = FIXED_GROUPS * last


_WIDTHS = ("hidden_size", "_dim", "channels", "width")


def _divides(groups: int, width) -> bool:
    return type(width) is int and width > groups and width % groups == 0


def tie_projection_to_text(out: dict, data: dict) -> None:
    """A tower's projection whose width is the text's hidden size (Janus's vision ``projection_dim``, its
    features placed among the text's embeddings): the copy's text width, not the tower's scaled one."""
    text, tiny = data.get("text_config"), out.get("text_config")
    if not isinstance(text, dict) or not isinstance(tiny, dict):
        return
    width, tiny_width = (t.get("hidden_size", t.get("d_model")) for t in (text, tiny))  # BART's text: d_model
    if not isinstance(width, int) or not isinstance(tiny_width, int):
        return
    for key, sub in data.items():
        if key == "text_config" or not isinstance(sub, dict) or not isinstance(out.get(key), dict):
            continue
        for field, value in sub.items():
            if str(field).endswith("projection_dim") and value == width != sub.get("hidden_size"):
                out[key][field] = tiny_width


def tie_channels_to_sibling(out: dict, data: dict) -> None:
    """A convnet's last channels that feed a sibling tower as its patch embeddings (Unlimited OCR's SAM
    ``downsample_channels`` into its CLIP encoder): the copy's last channels are the copy's sibling's width."""
    subs = [k for k, v in data.items() if isinstance(v, dict) and isinstance(out.get(k), dict)]
    for key in subs:
        for field, value in data[key].items():
            if not str(field).endswith("channels") or not isinstance(value, list) or not value:
                continue
            for other in subs:
                width = out[other].get("hidden_size")
                if other != key and value[-1] == data[other].get("hidden_size") and isinstance(width, int):
                    out[key][field] = [*out[key].get(field, value)[:-1], width]


def tie_used_vocab(out: dict, data: dict) -> None:
    """The part of a padded vocabulary that holds tokens (Inkling's ``unpadded_vocab_size``, most of its
    ``vocab_size``): the same part of the copy's vocabulary, or its head scores ids its embedding lacks
    (scaled as a width, 1392 of 99) and generate picks them."""
    vocab, tiny = data.get("vocab_size"), out.get("vocab_size")
    if not isinstance(vocab, int) or not isinstance(tiny, int):
        return
    for key, value in data.items():
        if key.endswith("unpadded_vocab_size") and type(value) is int and 0 < value <= vocab:
            out[key] = value * tiny // vocab


def tie_sibling_width(out: dict, data: dict) -> None:
    """A sub-config's width that is another sub-config's hidden size, unlike its own (Dia's decoder
    ``cross_hidden_size``: its encoder's, which it cross-attends to): the copy's other tower's."""
    subs = {k: v for k, v in data.items() if isinstance(v, dict) and "model_type" in v and isinstance(out.get(k), dict)}
    for name, sub in subs.items():
        for key, value in sub.items():
            if not str(key).endswith("_hidden_size") or type(value) is not int or value == sub.get("hidden_size"):
                continue
            other = next((o for o in subs if o != name and subs[o].get("hidden_size") == value), None)
            if other is not None and isinstance(out[other].get("hidden_size"), int):
                out[name][key] = out[other]["hidden_size"]


def tie_codebook_vocab(out: dict, data: dict) -> None:
    """A vocabulary of audio codes that is a codec sub-config's ``codebook_size`` (plus a pad: Kyutai's
    ``codebook_vocab_size``, 2048 + 1): the copy's codec's, or the codes it gives index past the table."""
    for name, sub in data.items():
        tiny = out.get(name)
        if not isinstance(sub, dict) or not isinstance(tiny, dict) or not isinstance(sub.get("codebook_size"), int):
            continue
        for key, value in data.items():
            if key.endswith("vocab_size") and type(value) is int and 0 <= value - sub["codebook_size"] <= 1:
                out[key] = tiny.get("codebook_size", sub["codebook_size"]) + value - sub["codebook_size"]


POSITIONS = 64  # the copy's positions (the recipe's max_position_embeddings)


def tie_samples_to_hop(out: dict, data: dict) -> None:
    """A length in audio samples that a codec sub-config's hop divides (the product of its ``downsampling_ratios``:
    VibeVoice ASR's ``acoustic_tokenizer_chunk_size``, 450 hops of 3200, validated): a length, not a width; the
    copy's is as many hops as the copy has positions."""
    hops = {math.prod(s["downsampling_ratios"]) for s in data.values() if _int_ratios(s)}
    for key, value in data.items():
        hop = next((h for h in hops if type(value) is int and value > h and value % h == 0), None)
        if hop is not None and key.endswith("_size") and key in out:
            out[key] = min(value, POSITIONS * hop)


def _int_ratios(sub) -> bool:
    ratios = sub.get("downsampling_ratios") if isinstance(sub, dict) else None
    return isinstance(ratios, list) and bool(ratios) and all(type(r) is int for r in ratios)


def scale_override(values: dict, sizes: dict, data: dict) -> dict:
    """A per-layer override (Gemma 4's global layers with heads twice as wide) scaled as the global
    value it overrides was: still twice the tiny head."""
    out = dict(values)
    for key, value in values.items():
        full, tiny = data.get(key), sizes.get(key)
        if all(isinstance(v, int) and not isinstance(v, bool) for v in (value, full, tiny)) and full > 0:
            out[key] = max(1, round(value * tiny / full))
    for key in (k for k in KV_HEADS if k in values and values[k] == values.get("num_attention_heads")):
        out[key] = out["num_attention_heads"]  # ungrouped heads stay ungrouped (Dots3 Note's, validated)
    whole, tiny = data | values, sizes | out
    if "qk_nope_head_dim" in values and whole["qk_nope_head_dim"] + whole.get("qk_rope_head_dim", 0) == whole.get(
        "head_dim"
    ):  # a head of an unrotated and a rotated part adding up to head_dim (Dots3 Note's sliding layers, validated)
        out["qk_nope_head_dim"] = tiny["head_dim"] - tiny["qk_rope_head_dim"]
    for key in (k for k in values if k.endswith("experts") and type(out[k]) is int):
        # a layer's fewer experts (Dots3 Note's vision layers: 4 of 64) still as many as each token is routed to
        out[key] = max(out[key], tiny.get("num_experts_per_tok", 1))
    return out


def _int_list(value) -> bool:
    return isinstance(value, (list, tuple)) and all(type(v) is int for v in value)


def tie_heads_of_64(out: dict, data: dict) -> None:
    """A sibling of the vision tower as wide as it, with a head per 64 of its features (Granite 4 Vision's Q-Former,
    whose heads the config class derives as the vision width // 64: none at the copy's 32): the copy's vision tower
    two such heads wide."""
    vision, tiny = data.get("vision_config"), out.get("vision_config")
    width = vision.get("hidden_size") if isinstance(vision, dict) and isinstance(tiny, dict) else None
    if type(width) is not int or width < 64 or tiny.get("hidden_size", width) >= 128:
        return
    for key, sub in data.items():
        derived = isinstance(sub, dict) and sub.get("encoder_hidden_size") == sub.get("hidden_size") == width
        if key != "vision_config" and derived and sub.get("num_attention_heads") == width // 64:
            tiny["hidden_size"] = 2 * 64
