"""ViT (transformers): q/k/v/o projections and the MLP split; patch embeddings and heads replicated."""

from __future__ import annotations

from transformers.models.vit import modeling_vit as hf

from shardformer.policies.base import Argument, Col_Layer, Dropout_Layer, Policy, Row_Layer, divide


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
        return [Col_Layer("attention.q_proj"), Col_Layer("attention.k_proj"), Col_Layer("attention.v_proj")]

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

    # pipeline (ViTForImageClassification): embeddings on the first stage, layernorm and classifier
    # on the last
    def pipeline_layers(self, model):
        return "vit.layers" if isinstance(model, hf.ViTForImageClassification) else None

    def pipeline_first(self, model):
        return ["vit.embeddings"]

    def pipeline_last(self, model):
        return ["vit.layernorm", "vit.pooler", "classifier"]

    def stage_forward(self, model, hidden, inputs):
        return vit_classification_stage_forward(model, hidden, inputs)


def vit_classification_stage_forward(model, hidden, inputs):
    """One pipeline stage of ViTForImageClassification on a micro-batch."""
    from transformers.masking_utils import create_bidirectional_mask
    from transformers.modeling_outputs import ImageClassifierOutput

    from shardformer.pipeline.split import local_layers

    v = model.vit
    stage, num_stages = getattr(model, "shardformer_stage", (0, 1))
    if stage == 0:
        pixels = inputs["pixel_values"]
        dtype = v.embeddings.patch_embeddings.projection.weight.dtype
        hidden = v.embeddings(pixels.to(dtype), interpolate_pos_encoding=inputs.get("interpolate_pos_encoding"))
    mask = create_bidirectional_mask(config=v.config, inputs_embeds=hidden, attention_mask=inputs.get("attention_mask"))
    for layer in local_layers(model, v.layers):
        hidden = layer(hidden, mask)
    if stage < num_stages - 1:
        return hidden
    logits = model.classifier(v.layernorm(hidden)[:, 0, :])
    labels = inputs.get("labels")
    loss = None if labels is None else model.loss_function(labels, logits, model.config)
    return ImageClassifierOutput(loss=loss, logits=logits)
