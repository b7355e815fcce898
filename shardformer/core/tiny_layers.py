"""Which layers a tiny copy keeps: one of each kind the full model has.

A hybrid model's per-layer schedule (``layer_types``: sliding and full attention, linear attention
and attention, Mamba and attention; ``no_rope_layers``; lists of layer indices such as Zamba2's
``hybrid_layer_ids``; Gemma 4's ``per_layer_config``; Mistral Large 4's ``kv_source_layers``, each layer's
source of keys and values) must keep its length equal to the depth, and
a tiny copy of two layers cut from the front may hold only one kind (Qwen3-Next's first full
attention layer is its fourth). The tiny copy keeps the first layer of every distinct kind, in
order, and every per-layer setting follows the kept layers.
"""

from __future__ import annotations

DEPTH_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
MAX_KINDS = 6  # per-layer values with more kinds than this (a width per layer) do not tell layers apart


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
        if len(set(v)) > MAX_KINDS
        and all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= i for i, s in enumerate(v))
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


def kept_layers(data: dict, aliases: dict, settable=lambda key: True, count: int | None = None) -> list[int] | None:
    """The original indices of the layers a tiny copy keeps (at least two; ``count`` exactly, where
    the config fixes the depth, filled with the first layers not kept yet), or None when the model has
    no per-layer schedule (then the first two layers are as good as any)."""
    depth = depth_of(data, aliases)
    if not depth or depth <= 2:
        return None
    lists = [v for v in _per_layer_lists(data, depth, settable).values() if len({str(x) for x in v}) <= MAX_KINDS]
    indexed = [set(v) for v in _index_lists(data, depth, settable).values()]
    overridden = {int(k) for k in (data.get("per_layer_config") or {})}
    if not lists and not indexed and not overridden:
        return None
    kinds: dict[tuple, int] = {}
    for i in range(depth):
        kind = (*(str(v[i]) for v in lists), *(i in s for s in indexed), i in overridden)
        kinds.setdefault(kind, i)
    keep = sorted(kinds.values())
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
