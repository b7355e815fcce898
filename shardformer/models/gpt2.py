"""GPT-2: Conv1D layers (weights [in, out]: reversed), fused c_attn (n_cast=3), tied wte / lm_head.

The family record: policies, the layer stack ``h``, GPT2LMHeadModel's pipeline split and stage
forward, and the tiny / named builds."""

from __future__ import annotations

import transformers as tf
from transformers.models.gpt2 import modeling_gpt2 as hf

from shardformer.models import ModelFamily
from shardformer.models.tiny import tiny_config
from shardformer.pipeline.spec import PipelineSpec, stage_of
from shardformer.pipeline.stage_view import Returns, own_forward, stage_view
from shardformer.tensor_parallel.layers import VocabParallelEmbedding1D, VocabParallelLMHead1D
from shardformer.tensor_parallel.layers.attention_dropout import attention_dropout_rng
from shardformer.tensor_parallel.lm_head import forward_like, token_loss, with_loss
from shardformer.tensor_parallel.policy import Argument, Col_Layer, Dropout_Layer, Layer, Policy, Row_Layer, divide


class GPT2Policy(Policy):
    """GPT2Model and the heads that only add replicated layers on top of it."""

    def argument_policy(self, config, shard_config):
        tp = shard_config.tensor_parallel_size
        if getattr(config, "add_cross_attention", False):
            raise NotImplementedError("GPT-2 with add_cross_attention=True has no built-in policy yet")
        divide(config.num_attention_heads, tp, "num_attention_heads")
        local = divide(config.hidden_size, tp, "hidden_size")
        divide(config.n_inner or 4 * config.hidden_size, tp, "n_inner (MLP width)")
        return {
            hf.GPT2Model: Argument({}, [self.embedding, self.embedding_dropout]),
            hf.GPT2Block: Argument(
                # GPT2Attention splits c_attn's output with split_size and views heads as -1:
                # with a local split_size each rank runs its own heads.
                {"attn.split_size": local, "attn.embed_dim": local, "attn.num_heads": config.num_attention_heads // tp},
                [self.attn_in, self.attn_out, self.mlp_in, self.mlp_out],
            ),
        }

    @staticmethod
    def attn_in():
        return [
            Col_Layer("attn.c_attn", reversed=True, n_cast=3),
            Dropout_Layer("attn.attn_dropout", parallel_input=True),
            # eager/sdpa attention read only attn_dropout.p: the per-rank stream around the attention
            Layer("attn", replace_layer=attention_dropout_rng("attn_dropout.p")),
        ]

    @staticmethod
    def attn_out():
        return [Row_Layer("attn.c_proj", reversed=True), Dropout_Layer("attn.resid_dropout")]

    @staticmethod
    def mlp_in():
        return [Col_Layer("mlp.c_fc", reversed=True)]

    @staticmethod
    def mlp_out():
        return [Row_Layer("mlp.c_proj", reversed=True), Dropout_Layer("mlp.dropout")]

    @staticmethod
    def embedding():
        return [Col_Layer("wte", bias=None, replace_layer=VocabParallelEmbedding1D)]

    @staticmethod
    def embedding_dropout():
        return [Dropout_Layer("drop")]


class GPT2LMHeadPolicy(GPT2Policy):
    """Models with a tied ``lm_head``: vocab-parallel head and loss."""

    origin = hf.GPT2LMHeadModel

    def argument_policy(self, config, shard_config):
        arguments = super().argument_policy(config, shard_config)
        arguments[self.origin] = Argument({}, [self.unembedding])
        return arguments

    @staticmethod
    def unembedding():
        return [Col_Layer("lm_head", bias=None, replace_layer=VocabParallelLMHead1D)]

    def binding_policy(self):
        return {"transformer.wte.weight": "lm_head.weight"}

    # no inject_policy: transformers' own loss_function and generate() are routed through the
    # vocab-parallel head for every sharded model (shardformer.tensor_parallel.lm_head)


class GPT2DoubleHeadsPolicy(GPT2LMHeadPolicy):
    origin = hf.GPT2DoubleHeadsModel

    def inject_policy(self):
        return self.origin, VocabParallelGPT2DoubleHeadsModel


class VocabParallelGPT2DoubleHeadsModel(hf.GPT2DoubleHeadsModel):
    """GPT2DoubleHeadsModel whose LM loss runs on vocab-parallel logits (mc_loss is unchanged)."""

    @forward_like(hf.GPT2DoubleHeadsModel.forward)
    def forward(self, labels=None, return_dict=None, **kwargs):
        output = super().forward(return_dict=True, **kwargs)
        loss = None
        if labels is not None:
            loss = token_loss(output.logits[..., :-1, :], labels[..., 1:], self.lm_head)
        return with_loss(output, loss, return_dict)


def gpt2_lm_stage_forward(model, hidden, inputs):
    """One pipeline stage of GPT2LMHeadModel on a micro-batch: GPT-2's own forward (the whole model's
    on the last stage, head and loss included). After the first stage it runs on ``inputs_embeds``,
    ``wpe`` and the embedding dropout answering with the received hidden states: the embedding sum
    and its dropout were the first stage's, the position ids and causal mask are built again."""
    stage, num_stages = stage_of(model)
    extra = {k: inputs[k] for k in ("attention_mask", "position_ids") if inputs.get(k) is not None}
    if stage == 0:
        feed = {k: inputs[k] for k in ("input_ids", "inputs_embeds", "token_type_ids") if inputs.get(k) is not None}
        stand_ins = {}
    else:
        feed = {"inputs_embeds": hidden}
        stand_ins = dict.fromkeys(("transformer.wpe", "transformer.drop"), Returns(hidden))
    with stage_view(model, stand_ins):
        if stage < num_stages - 1:
            return model.transformer(**feed, **extra, use_cache=False).last_hidden_state
        return own_forward(model)(**feed, **extra, labels=inputs.get("labels"), use_cache=False)


FAMILY = ModelFamily(
    name="GPT-2",
    policies={
        **dict.fromkeys(
            ("GPT2Model", "GPT2ForSequenceClassification", "GPT2ForTokenClassification", "GPT2ForQuestionAnswering"),
            GPT2Policy,
        ),
        "GPT2LMHeadModel": GPT2LMHeadPolicy,
        "GPT2DoubleHeadsModel": GPT2DoubleHeadsPolicy,
    },
    layers="h",
    final_norm="ln_f",
    pipelines={
        # wte is tied to lm_head: on both end stages
        "GPT2LMHeadModel": PipelineSpec(
            layers="transformer.h",
            stage_forward=gpt2_lm_stage_forward,
            first=("transformer.wpe",),
            last=("transformer.ln_f", "lm_head"),
            shared=("transformer.wte",),
        ),
    },
    builds={
        "gpt2-tiny": lambda: tf.GPT2LMHeadModel(tiny_config(tf.GPT2Config, n_positions=32)),
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config()),
        "gpt2-medium": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=1024, n_layer=24, n_head=16)),
        "gpt2-large": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=1280, n_layer=36, n_head=20)),
    },
)
