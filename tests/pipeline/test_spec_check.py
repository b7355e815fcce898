"""Pipeline specs are checked before any process waits (issue 14, trap 6): no processes are started here."""

from dataclasses import replace

import pytest
import transformers as tf

from shardformer.models import gpt2 as gpt2_family
from shardformer.pipeline.spec_check import PipelineSpecError, check_pipeline_lists, check_pipeline_spec
from shardformer.policies.anatomy_pipeline import pipeline_spec_for
from shardformer.tools.model_source import build_model
from shardformer.tools.plan import plan_model


def gpt2():
    return tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=4, n_head=4, vocab_size=99))


GPT2 = gpt2_family.FAMILY.pipelines["GPT2LMHeadModel"]
# wte in first and shared: the engine used to deadlock until the timeout
WTE_TWICE = replace(GPT2, first=("transformer.wpe", "transformer.wte"))
# wte on the first stage only, its tied lm_head on the last: two copies drifting apart
TIED_NOT_SHARED = replace(GPT2, first=("transformer.wpe", "transformer.wte"), shared=())


def test_a_module_in_two_lists_is_refused_by_name():
    with pytest.raises(PipelineSpecError, match=r"'transformer.wte' is in pipeline shared and listed twice"):
        plan_model(gpt2(), tp=2, pp=2, pipeline=WTE_TWICE)


def test_a_tied_weight_across_stages_must_be_shared():
    with pytest.raises(
        PipelineSpecError, match=r"transformer.wte.weight \(first\), lm_head.weight \(last\) are one tied"
    ):
        plan_model(gpt2(), tp=1, pp=2, pipeline=TIED_NOT_SHARED)


def test_every_parameter_in_exactly_one_place():
    model = gpt2()
    with pytest.raises(PipelineSpecError, match=r"parameter 'transformer.wpe.weight' is in no pipeline list"):
        check_pipeline_lists(model, "transformer.h", [], ["transformer.ln_f", "lm_head"], ["transformer.wte"])
    with pytest.raises(PipelineSpecError, match=r"'transformer.h.0' is in pipeline first and overlaps 'transformer.h'"):
        check_pipeline_lists(model, "transformer.h", ["transformer.h.0"])
    with pytest.raises(PipelineSpecError, match=r"names 'transformer.embed', which is not in GPT2LMHeadModel"):
        check_pipeline_lists(model, "transformer.h", ["transformer.embed"])


@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny", "vit-tiny", "timm-vit-tiny"])
def test_builtin_specs_pass(name):
    model = build_model(name)
    check_pipeline_spec(pipeline_spec_for(model), model, 2)
