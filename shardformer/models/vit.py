"""ViT (transformers): q/k/v/o projections and the MLP split; patch embeddings and heads replicated.

The family record: policies, the layer stack ``layers``, ViTForImageClassification's pipeline split
and stage forward, and the tiny / named builds."""

from __future__ import annotations

import transformers as tf
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.models.vit import modeling_vit as hf

from shardformer.core.tiny import tiny_config
from shardformer.models import ModelFamily
from shardformer.pipeline.spec import PipelineSpec, local_layers, stage_of
from shardformer.pipeline.stage_view import Returns, own_forward, stage_view, stand_in
from shardformer.tensor_parallel.layers.attention_dropout import attention_dropout_rng
from shardformer.tensor_parallel.policy import Argument, Col_Layer, Dropout_Layer, Layer, Policy, Row_Layer, divide


class ViTPolicy(Policy):
    """ViTModel, ViTForImageClassification, ViTForMaskedImageModeling."""

    def argument_policy(self, config, shard_config):
        tp = shard_config.tensor_parallel_size
        heads = divide(config.num_attention_heads, tp, "num_attention_heads")
        divide(config.intermediate_size, tp, "intermediate_size")
        return {
            hf.ViTLayer: Argument(
                {"attention.num_attention_heads": heads},
                [self.attn_in, self.attn_out, self.mlp_in, self.mlp_out],
            ),
            hf.ViTEmbeddings: Argument({}, [self.embedding]),
        }

    @staticmethod
    def attn_in():
        return [
            Col_Layer("attention.q_proj"),
            Col_Layer("attention.k_proj"),
            Col_Layer("attention.v_proj"),
            # eager/sdpa attention read attention_dropout (a float): the per-rank stream around it
            Layer("attention", replace_layer=attention_dropout_rng("attention_dropout")),
        ]

    @staticmethod
    def attn_out():
        return [Row_Layer("attention.o_proj"), Dropout_Layer("dropout")]

    @staticmethod
    def mlp_in():
        return [Col_Layer("mlp.fc1")]

    @staticmethod
    def mlp_out():
        return [Row_Layer("mlp.fc2")]

    @staticmethod
    def embedding():
        return [Dropout_Layer("dropout")]


def vit_classification_stage_forward(model, hidden, inputs):
    """One pipeline stage of ViTForImageClassification on a micro-batch. The first stage runs ViT's own
    forward. ViTModel's forward reads the patch embedding's weight, which only the first stage holds,
    so later stages run their layers' own forwards, on the mask transformers' masking utilities build
    for ViT; the last then runs ViTForImageClassification's own forward (pooling, classifier, loss),
    its base model answering with the final norm's output."""
    stage, num_stages = stage_of(model)
    v = model.vit
    pixels = inputs.get("pixel_values")
    options = {k: inputs[k] for k in ("interpolate_pos_encoding", "attention_mask") if inputs.get(k) is not None}
    last = stage == num_stages - 1
    with stage_view(model):
        if stage == 0:
            if not last:
                return v(pixels, **options).last_hidden_state
            return own_forward(model)(pixels, labels=inputs.get("labels"), **options)
        mask = create_bidirectional_mask(
            config=v.config, inputs_embeds=hidden, attention_mask=options.get("attention_mask")
        )
        for layer in local_layers(model, v.layers):
            hidden = layer(hidden, mask)
        if not last:
            return hidden
        output = BaseModelOutputWithPooling(last_hidden_state=v.layernorm(hidden))
        with stand_in(model, {"vit": Returns(output)}):
            return own_forward(model)(pixels, labels=inputs.get("labels"), **options)


FAMILY = ModelFamily(
    name="ViT",
    policies=dict.fromkeys(("ViTModel", "ViTForImageClassification", "ViTForMaskedImageModeling"), ViTPolicy),
    layers="layers",
    final_norm="layernorm",
    pipelines={
        "ViTForImageClassification": PipelineSpec(
            layers="vit.layers",
            stage_forward=vit_classification_stage_forward,
            first=("vit.embeddings",),
            last=("vit.layernorm", "vit.pooler", "classifier"),
        ),
    },
    builds={
        "vit-tiny": lambda: tf.ViTForImageClassification(
            tiny_config(tf.ViTConfig, image_size=16, patch_size=4, num_labels=3)
        ),
        "vit-base": lambda: tf.ViTForImageClassification(tf.ViTConfig()),
    },
)
