"""GPT-2: Conv1D layers (weights [in, out]: reversed), fused c_attn (n_cast=3), tied wte / lm_head."""

from __future__ import annotations

from transformers.models.gpt2 import modeling_gpt2 as hf

from shardformer.layers import VocabParallelEmbedding1D, VocabParallelLMHead1D
from shardformer.policies.base import Argument, Col_Layer, Dropout_Layer, Policy, Row_Layer, divide
from shardformer.policies.lm_heads import VocabParallelGPT2DoubleHeadsModel


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
    # vocab-parallel head for every sharded model (shardformer.sharded_class)


class GPT2DoubleHeadsPolicy(GPT2LMHeadPolicy):
    origin = hf.GPT2DoubleHeadsModel

    def inject_policy(self):
        return self.origin, VocabParallelGPT2DoubleHeadsModel
