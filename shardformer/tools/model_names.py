"""The model names ``shardformer plan`` / ``verify`` know, and the usual spellings of them.

No torch or transformers import here: ``shardformer plan --help`` lists these names, and help must
stay fast. ``tests/test_model_names.py`` checks `KNOWN` against the builds the library
really has (``shardformer.models.builds()`` and ``model_source.PLAN_DERIVED``), so it cannot drift.

A name is matched on its spelling without case, organisation (``meta-llama/``), separators and the
suffixes a hub id adds (``-Instruct``, ``-hf``, ``-v0.1``, ...); Llama's minor versions (3.1, 3.3)
have their major version's shapes, and a Llama name without a version is the newest of that size.
"""

from __future__ import annotations

import difflib
import re

# canonical name -> what it is (the list `shardformer plan --help` prints)
KNOWN = {
    "gpt2": "GPT-2 small (124M)",
    "gpt2-medium": "GPT-2 medium (355M)",
    "gpt2-large": "GPT-2 large (774M)",
    "bert-base": "BERT base (110M)",
    "bert-large": "BERT large (340M)",
    "vit-base": "ViT-B/16 (86M)",
    "llama-7b": "Llama-2-7B's shapes (transformers' default LlamaConfig)",
    "llama3-8b": "Llama-3(.1)-8B",
    "llama3-70b": "Llama-3(.1, .3)-70B",
    "llama3-405b": "Llama-3.1-405B",
    "phi3-mini": "Phi-3-mini (3.8B)",
    "mixtral-8x7b": "Mixtral-8x7B (MoE, 8 experts)",
    "mixtral-8x22b": "Mixtral-8x22B (MoE, 8 experts)",
    "deepseek-v3": "DeepSeek-V3 (MoE, 256 routed experts, MLA)",
}
TINY = ("gpt2-tiny", "bert-tiny", "vit-tiny", "timm-vit-tiny")  # tiny test copies, one per built-in family

# spellings that mean another known model (after normalize())
ALIASES = {
    "llama8b": "llama3-8b",
    "llama70b": "llama3-70b",
    "llama405b": "llama3-405b",
    "llama27b": "llama-7b",
    "gpt2small": "gpt2",
    "phi3mini4k": "phi3-mini",
    "phi3mini128k": "phi3-mini",
    "vitpatch16224": "vit-base",
}

_DROPPED = {"instruct", "chat", "hf", "base", "it", "uncased", "cased", "meta"}


def normalize(name: str) -> str:
    """``meta-llama/Meta-Llama-3.1-70B-Instruct`` -> ``llama370b``: what two spellings share."""
    name = name.lower().rsplit("/", 1)[-1]
    name = re.sub(r"llama-?(\d)\.\d+", r"llama\1", name)  # Llama 3.1 / 3.3: Llama 3's shapes
    tokens = [t for t in re.split(r"[-_\s]+", name) if t and t not in _DROPPED and not re.fullmatch(r"v0\.\d+", t)]
    return re.sub(r"[^a-z0-9]", "", "".join(tokens))


def resolve_name(name: str, available) -> str | None:
    """The name in ``available`` that ``name`` spells (exactly, or after `normalize`), or None."""
    if name in available:
        return name
    by_key = {normalize(n): n for n in available}
    key = normalize(name)
    key = normalize(ALIASES[key]) if key in ALIASES else key
    return by_key.get(key)


def close_matches(name: str, available) -> list[str]:
    """Known names that look like ``name``, best first (for the error message)."""
    by_key = {normalize(n): n for n in available}
    keys = difflib.get_close_matches(normalize(name), list(by_key) + list(ALIASES), n=4, cutoff=0.5)
    out = [by_key.get(k) or ALIASES[k] for k in keys]
    return list(dict.fromkeys(out))


def known_names_help() -> str:
    """The list printed by ``shardformer plan --help``."""
    lines = ["built-in model names (hub-style spellings work too: llama-70b, Llama-3.1-70B, meta-llama/...):"]
    lines += [f"  {name:<16}{what}" for name, what in KNOWN.items()]
    lines.append(f"  {', '.join(TINY)}: tiny copies for tests")
    return "\n".join(lines)
