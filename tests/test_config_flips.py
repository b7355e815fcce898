"""sweeps/config_flips.py finds the config values a class's forward reads and changes each."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sweeps.config_flips import flips, read_keys  # noqa: E402


def test_the_values_granite_reads_are_found_and_flipped():
    values, read = read_keys("GraniteForCausalLM")
    assert {"embedding_multiplier", "residual_multiplier", "logits_scaling", "tie_word_embeddings"} <= read
    found = flips(values, read)
    assert {"embedding_multiplier": 2.0} in found and {
        "tie_word_embeddings": not values["tie_word_embeddings"]
    } in found
    assert not any("use_cache" in f or "initializer_range" in f for f in found), found  # how it is called or built


def test_each_kind_of_value_gets_a_change_that_bites():
    values = {
        "final_logit_softcapping": None, "attn_logit_softcapping": 50.0, "logit_scale": 2.0,
        "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 1.0}, "sliding_window": 4096,
        "layer_types": ["full_attention", "full_attention"], "use_qk_norm": False, "use_bidirectional_attention": None,
        "hidden_size": 16, "rms_norm_eps": 1e-6, "output_attentions": False, "unread": True,
    }  # fmt: skip
    got = flips(values, set(values) - {"unread"})
    assert got == [
        {"attn_logit_softcapping": 5.0},
        {"final_logit_softcapping": 1.0},
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
        {"logit_scale": 12.0},
        {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
        {"sliding_window": 4},
        {"use_bidirectional_attention": True},
        {"use_qk_norm": True},
    ], got
