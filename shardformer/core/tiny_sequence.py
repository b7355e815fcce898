"""The sequence a tiny copy's inputs have, and the sizes a model's training path ties to it.

Reformer runs its backward only in training mode (its reversible layers recompute activations there), and
training checks that its axial position factors multiply to the sequence length and that its attention chunks
divide it: a tiny copy's are fitted to `SEQ` (one chunk of the whole sequence: Reformer's cached LSH attention
fails to generate from a prompt as long as a shorter chunk). A hashing seed left unset (Reformer's ``hash_seed``) is fixed, so
that a copy and its cut hash alike.
"""

from __future__ import annotations

import math

SEQ = 8  # tokens per sequence of the tiny inputs


def fit_training_sequence(out: dict, data: dict) -> None:
    """Into ``out`` (the tiny config's values): the sequence sizes of ``data`` (the config) fitted to `SEQ`."""
    shape = data.get("axial_pos_shape")
    if isinstance(shape, (list, tuple)) and len(shape) == 2 and math.prod(shape) != SEQ:
        out["axial_pos_shape"] = [2, SEQ // 2]
    for key, value in data.items():
        if key.endswith("attn_chunk_length") and isinstance(value, int) and value > 0 and SEQ % value:
            out[key] = SEQ
        elif key.endswith("_seed") and value is None:
            out[key] = 0
