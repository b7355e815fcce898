"""Which layers a tiny copy keeps: one of each kind the full model has.

A hybrid model's per-layer schedule (``layer_types``: sliding and full attention, linear attention
and attention, Mamba and attention; ``no_rope_layers``; lists of layer indices such as Zamba2's
``hybrid_layer_ids``; Gemma 4's ``per_layer_config``; Mistral Large 4's ``kv_source_layers``, each layer's
source of keys and values) must keep its length equal to the depth, and
a tiny copy of two layers cut from the front may hold only one kind (Qwen3-Next's first full
attention layer is its fourth). The tiny copy keeps the first layer of every distinct kind, in
order, and every per-layer setting follows the kept layers; where only lists of layer indices mark the
kinds, whose layers a model may build as classes of their own (GraniteSpeech5's subsampling blocks), two layers of
the commonest kind, so that a class still repeats (a stack to cut). A hybrid's layers must also run small
(`fit_hybrid`): an attention layer where the schedule has none, Mamba-2 heads that fill the mixer.
"""

from __future__ import annotations

DEPTH_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
MAX_KINDS = 6  # per-layer values with more kinds than this (a width per layer) do not tell layers apart
OWN_CLASS = ("cross_attention", "hybrid")  # lists of layer indices naming layers of a class of their own
ATTENTION_KINDS = ("full_attention", "hybrid")  # layer kinds holding an attention cache (Zamba's hybrid layer)


def depth_keys(aliases: dict) -> tuple[str, ...]:
    """The names of the depth in a config (ConvNeXt's ``num_hidden_layers`` is its ``num_stages``)."""
    return (*DEPTH_KEYS, *(aliases[k] for k in DEPTH_KEYS if k in aliases))


def depth_of(data: dict, aliases: dict) -> int | None:
    values = (data.get(k) for k in depth_keys(aliases))
    return next((v for v in values if isinstance(v, int) and not isinstance(v, bool)), None)


def _per_layer_lists(data: dict, depth: int, settable) -> dict[str, list]:
    return {
        k: list(v)
        for k, v in data.items()
        if isinstance(v, (list, tuple)) and len(v) == depth and settable(k) and not k.startswith("_")
    }


def _source_lists(lists: dict[str, list]) -> dict[str, list[int]]:
    """Per-layer lists whose values are layer indices, each layer's at most its own (Mistral Large 4's
    ``kv_source_layers``: the earlier layer whose keys and values a layer reads): more values than kinds
    of layer, so indices to renumber, not a schedule."""
    return {
        k: v
        for k, v in lists.items()
        if all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= i for i, s in enumerate(v))
        and len(set(v)) > MAX_KINDS  # after the check: a list of lists (Moonshine's per-layer windows) has no set
    }


def _index_lists(data: dict, depth: int, settable) -> dict[str, list[int]]:
    """Lists of layer indices (``hybrid_layer_ids``, ``mlp_only_layers``)."""
    found = {}
    for k, v in data.items():
        if "layer" not in k or not isinstance(v, list) or not v or len(v) == depth or not settable(k):
            continue
        if all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < depth for i in v):
            found[k] = v
    return found


def kept_layers(
    data: dict, aliases: dict, settable=lambda key: True, count: int | None = None, recompute: bool = False
) -> list[int] | None:
    """The original indices of the layers a tiny copy keeps (at least two; ``count`` exactly, where
    the config fixes the depth, filled with the first layers not kept yet), or None when the model has
    no per-layer schedule (then the first two layers are as good as any) or, with ``recompute``, is no
    deeper than its copy (its schedule recomputed for the depth: GLM-MoE-DSA's given one may not run)."""
    depth = depth_of(data, aliases)
    if not depth:
        return None
    lists = [v for v in _per_layer_lists(data, depth, settable).values() if len({str(x) for x in v}) <= MAX_KINDS]
    index_lists = _index_lists(data, depth, settable)
    indexed = [set(v) for v in index_lists.values()]
    overridden = {int(k) for k in (data.get("per_layer_config") or {})}
    if not lists and not indexed and not overridden:
        return None
    if depth <= 2:  # a model as shallow as a copy (a tiny copy's copy): its schedule as it is, unless recomputed
        return None if recompute else list(range(depth))[:count] if count else list(range(depth))
    # Zamba's hybrid layers are a class of their own around a Mamba layer, sharing one attention block
    # tied over them, and so are Mllama's cross-attention layers: two layers of each kind keep each class
    # a stack (one of each is no repeated block to cut) and the tie between two layers
    own_class = any("hybrid" in map(str, v) for v in lists) or any(k.startswith(OWN_CLASS) for k in index_lists)
    per_kind = 2 if own_class else 1
    kinds: dict[tuple, list[int]] = {}
    every: dict[tuple, list[int]] = {}  # each kind's layers in the full model
    for i in range(depth):
        kind = (*(str(v[i]) for v in lists), *(i in s for s in indexed), i in overridden)
        every.setdefault(kind, []).append(i)
        if len(kinds.setdefault(kind, [])) < per_kind:
            kinds[kind].append(i)
    if indexed and not lists and all(len(layers) < 2 for layers in kinds.values()):
        # layers a list of indices marks, with no schedule for one class to read, may be built as a class of
        # their own (GraniteSpeech5's subsampling blocks, Mllama's cross-attention layers): the kind most
        # layers are keeps two, a stack of one class
        most = max(every, key=lambda kind: len(every[kind]))
        kinds[most] = every[most][:2]
    keep = sorted(i for layers in kinds.values() for i in layers)
    for sources in _source_lists(_per_layer_lists(data, depth, settable)).values():
        keep = sorted({*keep, *(sources[i] for i in keep)})  # a kept layer's source is kept with it
    rest = (i for i in range(depth) if i not in keep)
    while len(keep) < (count or 2):
        keep = sorted({*keep, next(rest)})
    return keep[:count] if count else keep


def layer_overrides(data: dict, aliases: dict, keep: list[int], settable, scale) -> dict:
    """The config values that follow ``keep``: the depth, every per-layer list, every list of layer
    indices, ``per_layer_config`` (its values passed through ``scale(dict) -> dict``)."""
    depth = depth_of(data, aliases)
    out = {k: len(keep) for k in depth_keys(aliases) if data.get(k) == depth}
    lists = _per_layer_lists(data, depth, settable)
    sources = _source_lists(lists)
    for key, values in lists.items():
        out[key] = [keep.index(values[i]) if key in sources else values[i] for i in keep]
    for key, indices in _index_lists(data, depth, settable).items():
        out[key] = [keep.index(i) for i in indices if i in keep]
    if data.get("per_layer_config") and settable("per_layer_config"):
        per_layer = {int(k): v for k, v in data["per_layer_config"].items()}
        out["per_layer_config"] = {new: scale(per_layer[old]) for new, old in enumerate(keep) if old in per_layer}
    return out


def lacks_attention(types) -> bool:
    """A per-layer schedule where no layer holds an attention cache: transformers' forward asks the
    cache for its length, which only such a layer knows (a cache of Mamba layers only raises)."""
    return isinstance(types, list) and bool(types) and not any(t in ATTENTION_KINDS for t in types)


def fit_hybrid(out: dict, data: dict) -> None:
    """``out`` (a tiny copy's overrides of the config ``data``) made to run for a hybrid: a schedule of
    Mamba layers only (Bamba's and GraniteMoeHybrid's default configs) gets attention in its last
    layer (`lacks_attention`); a Mamba-2 mixer's heads fill its inner width, ``expand x hidden``
    (Zamba2's ``n_mamba_heads`` shrinks as a head count while ``mamba_headdim`` shrinks as a width), or
    set it (Falcon-H1's ``mamba_d_ssm``, else as wide as its heads: one channel each). Dense layers
    before the experts (DeepSeek's ``first_k_dense_replace``, 3 of 61) leave the last layer MoE: a
    tiny copy of dense layers only has no experts to split or cut."""
    types, depth = out.get("layer_types"), depth_of(out, {})
    dense = data.get("first_k_dense_replace")
    if type(dense) is int and depth and dense >= depth:
        out["first_k_dense_replace"] = depth - 1
    if lacks_attention(types) and set(types) == {"linear_attention"}:
        out["layer_types"] = [*types[:-1], "full_attention"]
    if "attn_layer_indices" in data and not data["attn_layer_indices"] and depth:
        out["attn_layer_indices"] = [depth - 1]
    heads = next((k for k in data if k.startswith(("n_mamba", "mamba_n")) and k.endswith("heads")), None)
    width = out.get("mamba_headdim", data.get("mamba_headdim"))
    inner = data.get("mamba_expand", 0) * out.get("hidden_size", 0)
    if heads and type(width) is int and width > 0 and inner and inner % width == 0:
        out[heads] = inner // width
    ssm, head = data.get("mamba_d_ssm"), data.get("mamba_d_head")  # Falcon-H1 sets the inner width itself
    if heads in out and type(ssm) is int and type(head) is int:
        out["mamba_d_ssm"] = out[heads] * head


def fit_stages(out: dict, data: dict, hidden, scaling) -> None:
    """A convolutional network's stages (no hidden size, no attention heads: ResNet, RegNet, BiT): two blocks
    per stage at most (``depths``), which keeps each kind (the first, with its shortcut, and the others), and
    its widths (``hidden_sizes``, ``embedding_size``, RegNet's ``groups_width``) scaled by one factor so the
    widest is 64, each a multiple of 8 (not BiT's, whose norms hold 32 groups). EfficientNet's width and depth
    coefficients (B7's 2.0 and 3.1 by default) at 0.25 and 0.5, and its last width, the width coefficient's
    multiple of 1280, scaled with it. An audio encoder's first channels (``num_filters``), doubled at each
    downsampling, so its last are 64 at most. A tower that folds its patch a scale a layer: `_fit_patch_scales`."""
    _fit_patch_scales(out, data)
    depths, widths = data.get("depths"), data.get("hidden_sizes")
    if hidden is not None or "num_attention_heads" in data:  # attention stages (Segformer, PVT): as they were
        depths = widths = None
    if not scaling.keep_depth and _ints(depths):
        out["depths"] = [min(d, 2) for d in depths]
    if not scaling.keep_widths and _ints(widths) and max(widths) > 64 and "num_groups" not in data:
        scale = lambda w: max(8, round(w * 64 / max(widths) / 8) * 8)  # noqa: E731
        out["hidden_sizes"] = [scale(w) for w in widths]
        out.update({k: scale(data[k]) for k in ("embedding_size", "groups_width") if isinstance(data.get(k), int)})
    ratios, filters = data.get("downsampling_ratios"), data.get("num_filters")
    if not scaling.keep_widths and _ints(ratios) and type(filters) is int:
        # channels doubled at each downsampling from num_filters (VibeVoice's tokenizer: 32 up to 2048): 64 at most
        out["num_filters"] = max(1, min(filters, 64 >> len(ratios)))
    if isinstance(data.get("hidden_dim"), int) and data.get("width_coefficient") and data.get("depth_coefficient"):
        out.update(width_coefficient=0.25, depth_coefficient=0.5)
        out["hidden_dim"] = round(data["hidden_dim"] * 0.25 / data["width_coefficient"])


def _fit_patch_scales(out: dict, data: dict) -> None:
    """A tower that folds its patch into the text width one scale a layer (Inkling's vision encoder: the pixels,
    then one scale per prime factor of ``patch_size`` and of a ``temporal_patch_size`` over 1) keeps a layer per
    scale of the copy's patch: with fewer, the class assigns scales to layers with scipy's solver."""
    patch, frames = out.get("patch_size", data.get("patch_size")), data.get("temporal_patch_size")
    if "text_hidden_size" not in data or type(patch) is not int or type(frames) is not int or frames < 2:
        return
    scales = 1 + _prime_factors(patch) + _prime_factors(frames)
    for key in DEPTH_KEYS:
        if type(out.get(key)) is int and out[key] < scales <= data.get(key, 0):
            out[key] = scales


def _prime_factors(number: int) -> int:
    """How many prime factors ``number`` has, counted with their multiplicity (8: 3)."""
    count, factor = 0, 2
    while number > 1 and factor <= number:
        while number % factor == 0:
            number, count = number // factor, count + 1
        factor += 1
    return count


def _ints(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, int) for v in value)


def fit_tower_indices(out: dict, data: dict) -> None:
    """Layer indices one sub-config holds into the vision tower (Molmo2's adapter ``vision_feature_layer``,
    ``[24, 18]`` of 27 layers, negative ones counted from the end): at the same depth, in proportion, of the
    copy's tower (its validator refuses indices past it)."""
    _fit_layer_maps(out, data)
    full, depth = _depths(out, data, "vision_config")
    if not isinstance(full, int) or not isinstance(depth, int) or depth >= full:
        return
    for key, sub in data.items():
        scaled = out.get(key)
        if key == "vision_config" or not isinstance(sub, dict) or not isinstance(scaled, dict):
            continue
        for name, value in sub.items():
            if name.endswith("feature_layer") and _ints(value) and all(-full <= i < full for i in value):
                scaled[name] = [_fit_index(i, full, depth) for i in value]


def _depths(out: dict, data: dict, tower: str) -> tuple:
    """The depth of ``tower`` (a sub-config's name) in the user's config and in the copy."""
    return tuple(v.get("num_hidden_layers") if isinstance(v, dict) else None for v in (data.get(tower), out.get(tower)))


def _fit_index(index: int, full: int, depth: int) -> int:
    """A layer index of ``full`` layers (a negative one counted from the end) at the same depth, in proportion, of
    ``depth`` layers."""
    return min(depth - 1, index * depth // full) if index >= 0 else -max(1, -index * depth // full)


def _fit_layer_maps(out: dict, data: dict) -> None:
    """Layer indices the config holds into both towers (Granite 4 Vision: ``deepstack_layer_map``, pairs of a vision
    layer and the text layer it feeds; ``spatial_target_layers``, text layers): in proportion, as above."""
    vision, text = _depths(out, data, "vision_config"), _depths(out, data, "text_config")
    if not all(isinstance(d, int) for d in (*vision, *text)):
        return
    for key, value in data.items():
        pairs = isinstance(value, list) and all(isinstance(p, (list, tuple)) and _ints(list(p)) for p in value)
        if key.endswith("layer_map") and pairs and value and all(len(p) == 2 for p in value):
            out[key] = [[_fit_index(v, *vision), _fit_index(t, *text)] for v, t in value]
        elif key.endswith("target_layers") and _ints(value):
            out[key] = [_fit_index(t, *text) for t in value]
