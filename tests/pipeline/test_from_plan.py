"""Pipeline specs derived from transformers' base_model_pp_plan, in one process.

Stages run one after another compute the unsharded model's loss and logits; parameter names stay
the model's; the tied input embedding is held by both end stages.
"""

import copy

import pytest
import torch
import transformers as tf

from shardformer import shard_model
from shardformer.core.tiny import tiny_config
from shardformer.policies.anatomy_pipeline import pipeline_spec_for
from tests.helpers import assert_close


def _pair(name, **config):
    cls = getattr(tf, name)
    cfg = tiny_config(cls.config_class, num_hidden_layers=4, **config)
    torch.manual_seed(0)
    ref = cls(cfg).eval()
    return ref, copy.deepcopy(ref)


@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("LlamaForCausalLM", {}),
        ("LlamaForCausalLM", {"tie_word_embeddings": True}),
        ("Gemma2ForCausalLM", {}),  # per-layer attention types, indexed by global layer number
        ("GPTNeoXForCausalLM", {}),  # embedding dropout and final_layer_norm
        ("Phi3ForCausalLM", {}),
    ],
)
def test_stages_in_sequence_equal_the_model(name, config):
    ref, model = _pair(name, **config)
    spec = pipeline_spec_for(model)
    model = shard_model(model)
    stages = [spec.keep_stage(copy.deepcopy(model), s, 3, [1, 2, 1]) for s in range(3)]
    ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
    hidden = None
    for stage in stages:
        hidden = spec.stage_forward(stage, hidden, inputs)
    expected = ref(**inputs)
    assert_close(hidden.loss, expected.loss, what=f"{name} loss")
    assert_close(hidden.logits, expected.logits, what=f"{name} logits")
    full = {n for n, _ in ref.named_parameters()}
    names = [{n for n, _ in m.named_parameters()} for m in stages]
    assert set().union(*names) == full and all(n <= full for n in names)
    if config.get("tie_word_embeddings"):
        assert spec.shared == ("model.embed_tokens",) and stages[2].model.embed_tokens is not None
    assert stages[1].model.layers[0] is None if name != "GPTNeoXForCausalLM" else stages[1].gpt_neox.layers[0] is None


def test_a_plan_naming_children_the_model_lacks_gives_no_spec():
    """HRM's pp plan names ``layers``, which its model does not have: no spec and no final norm (sequence
    parallelism then refuses for want of a layer stack instead of failing with an AttributeError)."""
    from shardformer.pipeline.from_plan import final_norm_from_pp_plan, spec_from_pp_plan

    model_class = tf.HrmTextForCausalLM
    model = model_class(tiny_config(model_class.config_class))
    assert "layers" in model.config.base_model_pp_plan
    assert spec_from_pp_plan(model) is None and final_norm_from_pp_plan(model) is None


def test_a_plan_whose_layers_hand_on_more_than_hidden_states_is_refused():
    """GLM-MoE-DSA's pp plan says its layers return the hidden states, but each returns (hidden states,
    top-k indices) and the next layer reads the indices: the plan's stages would unpack a pass-through's
    bare tensor along the batch (the pp=2 sweep hung on it). Refused before any collective, naming why."""
    model_class = tf.GlmMoeDsaForCausalLM
    model = model_class(tiny_config(model_class.config_class, num_hidden_layers=2))
    with pytest.raises(NotImplementedError, match="reads prev_topk_indices from what layer 0 returned"):
        pipeline_spec_for(model)
