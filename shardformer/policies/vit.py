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
