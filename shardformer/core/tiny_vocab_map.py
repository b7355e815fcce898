"""Codebooks whose codes are tokens of the text, fitted to the tiny vocabulary: a token map and code ranges.

Chameleon and Emu3 read their image tokens from such a map, which their checkpoints' configs copy from the
tokenizer: one name per code of the VQ-VAE's codebook (Chameleon's ``IMGIMG...Z``, Emu3's ``<|visual token
000123|>``) and names the model looks up (``<image>``). A tiny copy has 99 token ids: its codebook keeps
`CODES` codes, and the map keeps the names of that many codes (the family of names sharing the most common
prefix, lowest ids first) and the bracketed names (``<image>``, ``<|extra_200|>``) that still fit, each
re-numbered to an id of the tiny vocabulary, as are the config's token ids that the map names (Chameleon's
``image_token_id``, its ``<image>``). Names keep their spelling: the model decodes codes from them.

Apertus 1.5 instead adds an offset to each tokenizer's codes (``image_token_offset``, ``audio_token_offset``):
ranges laid end to end after the text's tokens, one codebook each (its validator checks it). A tiny copy keeps
them end to end, `CODES` codes each, from a third of its vocabulary up (its special ids sit at the top).
"""

from __future__ import annotations

from collections import Counter

CODES = 32  # codes of a tiny codebook whose codes are tokens of the text (a third of the 99 ids)
FIRST_ID = 3  # after pad, bos and eos (`shardformer.core.tiny.SIZES`)
_PREFIX = 6  # characters that name a family of code names ("IMGIMG", "<|visu")
_CODEBOOK_KEYS = ("num_embeddings", "codebook_size")


def fit_codebooks(out: dict, data: dict, vocab: int) -> None:
    """In ``out`` (the copy's values of the config ``data``): its token map and code ranges fitted to ``vocab``."""
    fit_vocabulary_map(out, data, vocab)
    fit_code_ranges(out, data, vocab)


def fit_vocabulary_map(out: dict, data: dict, vocab: int) -> None:
    """In ``out`` (the copy's values of the config ``data``, as dicts): a ``vocabulary_map`` of ``data`` and the
    codebook of its sub-configs, fitted to ``vocab`` ids."""
    names = data.get("vocabulary_map")
    if not isinstance(names, dict) or not names:
        return
    for key, sub in data.items():
        tiny = out.get(key)
        if isinstance(sub, dict) and isinstance(tiny, dict):
            tiny.update({k: CODES for k in _CODEBOOK_KEYS if type(sub.get(k)) is int and sub[k] > CODES})
    tiny = tiny_vocabulary_map(names, vocab)
    out["vocabulary_map"] = tiny
    renumbered = {names[n]: i for n, i in tiny.items()}
    for key, value in data.items():  # the ids the config read from the map (image_token_id: its "<image>")
        if key.endswith("_token_id") and type(value) is int and value in renumbered:
            out[key] = renumbered[value]


def fit_code_ranges(out: dict, data: dict, vocab: int) -> None:
    """In ``out``: ``data``'s ``*_token_offset`` ranges, each a sub-config's ``codebook_size`` long (the one that
    ends where the next range begins, or inside the vocabulary), re-laid end to end in ``vocab`` ids."""
    offsets = sorted((v, k) for k, v in data.items() if k.endswith("_token_offset") and type(v) is int)
    books = {
        k: v["codebook_size"] for k, v in data.items() if isinstance(v, dict) and type(v.get("codebook_size")) is int
    }
    start = vocab // 3
    for i, (offset, key) in enumerate(offsets):
        end = offsets[i + 1][0] if i + 1 < len(offsets) else None
        fits = [k for k, n in books.items() if offset + n == end or end is None and isinstance(out.get(k), dict)]
        if not fits:
            return  # not ranges of codebooks: left as scaled
        out[key] = start
        out[fits[0]]["codebook_size"] = min(CODES // 2, books.pop(fits[0]))
        start += out[fits[0]]["codebook_size"]


def tiny_vocabulary_map(names: dict[str, int], vocab: int) -> dict[str, int]:
    """``names`` (token name -> id) cut to `CODES` code names and the bracketed names that fit in ``vocab`` ids,
    numbered from `FIRST_ID` in the order of their ids."""
    by_id = sorted(names, key=names.__getitem__)
    family = Counter(n[:_PREFIX] for n in by_id).most_common(1)[0][0]
    codes = [n for n in by_id if n.startswith(family)][:CODES]
    room = vocab - FIRST_ID - len(codes)
    bracketed = [n for n in by_id if not n.startswith(family) and n.startswith("<") and n.endswith(">")][:room]
    kept = sorted(codes + bracketed, key=names.__getitem__)
    return {name: FIRST_ID + i for i, name in enumerate(kept)}
