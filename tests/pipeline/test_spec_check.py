"""Pipeline specs are checked before any process waits (issue 14, trap 6): no processes are started here."""

import pytest
import transformers as tf

from shardformer.pipeline.spec_check import PipelineSpecError, check_pipeline_lists
from shardformer.plan import plan_model
from shardformer.policies.gpt2 import GPT2LMHeadPolicy
from shardformer.verify import build_model


def gpt2():
    return tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=4, n_head=4, vocab_size=99))


class WteTwice(GPT2LMHeadPolicy):  # first and shared: the engine used to deadlock until the timeout
    def pipeline_first(self, model):
        return ["transformer.wpe", "transformer.wte"]


class TiedNotShared(GPT2LMHeadPolicy):  # wte on the first stage only, its tied lm_head on the last
    def pipeline_first(self, model):
        return ["transformer.wpe", "transformer.wte"]

    def pipeline_shared(self, model):
        return []


def test_a_module_in_two_lists_is_refused_by_name():
    with pytest.raises(PipelineSpecError, match=r"'transformer.wte' is in pipeline shared and listed twice"):
        plan_model(gpt2(), tp=2, pp=2, policy=WteTwice())


def test_a_tied_weight_across_stages_must_be_shared():
    with pytest.raises(
        PipelineSpecError, match=r"transformer.wte.weight \(first\), lm_head.weight \(last\) are one tied"
    ):
        plan_model(gpt2(), tp=1, pp=2, policy=TiedNotShared())


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
    from shardformer.pipeline.spec_check import check_policy_pipeline
    from shardformer.policies.auto import get_autopolicy

    model = build_model(name)
    policy = get_autopolicy(model)
    policy.set_model(model)
    check_policy_pipeline(policy, model, 2)
