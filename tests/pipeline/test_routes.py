"""Every pipeline route is a hypothesis the tiny-copy proof decides, with the user's config values; one
process, no spawn (tests/pipeline/test_engine_from_plan.py and test_engine_anatomy.py train Granite and
DeBERTa-v2 through ParallelEngine against the unsharded model)."""

import dataclasses

import pytest
import torch
import transformers as tf

from shardformer import ShardConfig, shard_model
from shardformer.core.record import ATTRIBUTE
from shardformer.core.tiny import tiny_config
from shardformer.models import family_spec
from shardformer.pipeline.from_plan import plan_stage_forward, spec_from_pp_plan
from shardformer.pipeline.spec_check import check_pipeline_spec
from shardformer.policies.anatomy_pipeline import AnatomyStageForward, pipeline_spec_for
from shardformer.policies.pipeline_proof import route_verdict

GRANITE = dict(embedding_multiplier=12.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=2.0)


def _granite(**values):
    return tf.GraniteForCausalLM(tiny_config(tf.GraniteConfig, num_hidden_layers=4, **values))


def test_a_plan_whose_stages_skip_the_forwards_own_code_passes_to_the_anatomy_route():
    """Granite's plan stages skip its embedding multiplier: proven on a copy with the user's values, the plan
    is refused there and the anatomy route taken; with the default multipliers (1.0) the plan is exact
    and taken. One process, the multiplied config first: a verdict cached per class would carry over."""
    scaled = _granite(**GRANITE)
    why = route_verdict(scaled, "pp plan", spec_from_pp_plan)
    assert why is not None and "the loss (or output) differs" in why, why
    assert isinstance(pipeline_spec_for(scaled).stage_forward, AnatomyStageForward)
    assert pipeline_spec_for(_granite()).stage_forward is plan_stage_forward


class _DoubledGPT2Model(tf.GPT2Model):
    """Doubles its output: GPT-2's hand-written stages hand on what the base model returns (with its final
    norm dropped), so a stage would receive the hidden states doubled, where the layers never see them so."""

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        output.last_hidden_state = output.last_hidden_state * 2.0
        return output


class GPT2LMHeadModel(tf.GPT2LMHeadModel):  # the GPT-2 family knows it by this name
    def __init__(self, config):
        super().__init__(config)
        self.transformer = _DoubledGPT2Model(config)
        self.post_init()


def test_a_family_spec_is_proven_on_the_users_model_too():
    """GPT-2's hand-written spec is exact on GPT-2 and BERT's on BERT; on a GPT-2 whose base model
    doubles its output it is not, and the anatomy route (exact) is taken instead."""
    for model in (
        tf.GPT2LMHeadModel(tiny_config(tf.GPT2Config, n_layer=2)),
        tf.BertForMaskedLM(tiny_config(tf.BertConfig, num_hidden_layers=2)),
    ):
        assert pipeline_spec_for(model) is family_spec(model) is not None
    doubled = GPT2LMHeadModel(tiny_config(tf.GPT2Config, n_layer=2))
    assert family_spec(doubled) is not None
    assert route_verdict(doubled, "family", family_spec) is not None
    assert isinstance(pipeline_spec_for(doubled).stage_forward, AnatomyStageForward)


def test_no_exact_route_is_refused_naming_each_routes_reason():
    """GLM-MoE-DSA's layers hand the next one their top-k indices: the plan and the anatomy both refuse,
    the reason said once."""
    model = tf.GlmMoeDsaForCausalLM(tiny_config(tf.GlmMoeDsaConfig, num_hidden_layers=2))
    with pytest.raises(NotImplementedError) as refused:
        pipeline_spec_for(model)
    message = str(refused.value)
    assert "reads prev_topk_indices from what layer 0 returned" in message
    assert message.endswith("The other routes: transformers' pp plan: the same"), message


def _deberta():
    config = tiny_config(
        tf.DebertaV2Config, num_hidden_layers=4, relative_attention=True, position_buckets=8,
        pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm", max_relative_positions=-1,
    )  # fmt: skip
    return tf.DebertaV2ForMaskedLM(config)


def test_modules_every_layer_reads_are_on_every_stage_and_a_stage_without_them_is_named():
    """DeBERTa-v2 with relative attention hands every layer its normalised relative embeddings: both
    modules go on every stage (a middle one of four too). Placed on one end stage instead, the proof
    names the weight a stage read without holding it."""
    model = _deberta()
    spec = pipeline_spec_for(model)
    assert spec.every == ("deberta.encoder.LayerNorm", "deberta.encoder.rel_embeddings")
    check_pipeline_spec(spec, model, 4)
    middle = spec.keep_stage(model, 1, 4)
    assert middle.deberta.encoder.rel_embeddings is not None and middle.deberta.encoder.LayerNorm is not None
    assert middle.deberta.embeddings is None or middle.deberta.embeddings.word_embeddings is None

    def ends_only(tiny):
        found = pipeline_spec_for(tiny)
        return dataclasses.replace(found, every=(), last=found.last + found.every)

    why = route_verdict(_deberta(), "rel_embeddings on the last stage only", ends_only)
    assert "a stage read deberta.encoder.rel_embeddings.weight, of a module another stage holds" in why, why


def test_shard_model_refuses_pipeline_stages_before_any_collective():
    """shard_model does not split a model into stages: at pp=2 every rank would train a whole copy. Refused
    before torch.distributed is needed (no process group here), the model untouched."""
    model = tf.GPT2LMHeadModel(tiny_config(tf.GPT2Config, n_layer=2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"^train in pipeline stages with ParallelEngine\(model, optimizer, Engine"):
        shard_model(model, ShardConfig(tensor_parallel_size=2, pipeline_parallel_size=2))
    assert ATTRIBUTE not in model.__dict__
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_pipeline_route_is_proven_on_the_instance():
    """The same class, clean and then changed on the instance, in one process: a forward patched on the
    base model (the plan's stages never call it) sends the proof to the anatomy route, which runs the
    model's own forward per stage; a clean instance still takes the plan."""
    import types

    def scaled_forward(self, *args, **kwargs):
        out = type(self).forward(self, *args, **kwargs)
        out.last_hidden_state = out.last_hidden_state * 3.0
        return out

    clean = _granite()
    assert pipeline_spec_for(clean).stage_forward is plan_stage_forward
    patched = _granite()
    patched.model.forward = types.MethodType(scaled_forward, patched.model)
    assert route_verdict(patched, "pp plan", spec_from_pp_plan) is not None
    assert pipeline_spec_for(patched).stage_forward is not plan_stage_forward
