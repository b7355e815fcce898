"""BERT: separate query/key/value Linears, vocab-parallel MLM decoder tied to the word embeddings."""

from __future__ import annotations

from transformers.models.bert import modeling_bert as hf

from shardformer.layers import VocabParallelEmbedding1D, VocabParallelLMHead1D
from shardformer.policies.base import Argument, Col_Layer, Dropout_Layer, Policy, Row_Layer, divide
from shardformer.policies.lm_heads import (
    VocabParallelBertForMaskedLM,
    VocabParallelBertForPreTraining,
)


class BertPolicy(Policy):
    """BertModel and the heads that only add replicated layers (classifiers, pooler, NSP)."""

    def argument_policy(self, config, shard_config):
        tp = shard_config.tensor_parallel_size
        if getattr(config, "add_cross_attention", False):
            raise NotImplementedError("BERT with add_cross_attention=True has no built-in policy yet")
        heads = divide(config.num_attention_heads, tp, "num_attention_heads")
        divide(config.hidden_size, tp, "hidden_size")
        divide(config.intermediate_size, tp, "intermediate_size")
        head_size = config.hidden_size // config.num_attention_heads
        return {
            hf.BertEmbeddings: Argument({}, [self.embedding]),
            hf.BertLayer: Argument(
                {"attention.self.num_attention_heads": heads, "attention.self.all_head_size": heads * head_size},
                [self.attn_in, self.attn_out, self.mlp_in, self.mlp_out],
            ),
        }

    def sequence_parallel_entries(self):
        # BertAttention adds its input back inside (BertSelfOutput): gather below it, at the q/k/v block
        return ["attention.self", "intermediate"]

    @staticmethod
    def attn_in():
        return [
            Col_Layer("attention.self.query"),
            Col_Layer("attention.self.key"),
            Col_Layer("attention.self.value"),
            Dropout_Layer("attention.self.dropout", parallel_input=True),
        ]

    @staticmethod
    def attn_out():
        return [Row_Layer("attention.output.dense"), Dropout_Layer("attention.output.dropout")]

    @staticmethod
    def mlp_in():
        return [Col_Layer("intermediate.dense")]

    @staticmethod
    def mlp_out():
        return [Row_Layer("output.dense"), Dropout_Layer("output.dropout")]

    @staticmethod
    def embedding():
        return [
            Col_Layer("word_embeddings", bias=None, replace_layer=VocabParallelEmbedding1D),
            Dropout_Layer("dropout"),
        ]


class BertMLMPolicy(BertPolicy):
    """Heads with an MLM decoder (cls.predictions): vocab-parallel decoder and loss."""

    origin: type = hf.BertForMaskedLM
    custom: type | None = None

    def argument_policy(self, config, shard_config):
        arguments = super().argument_policy(config, shard_config)
        arguments[hf.BertLMPredictionHead] = Argument({}, [self.unembedding])
        return arguments

    @staticmethod
    def unembedding():
        return [Col_Layer("decoder", replace_layer=VocabParallelLMHead1D)]

    def binding_policy(self):
        return {
            "bert.embeddings.word_embeddings.weight": "cls.predictions.decoder.weight",
            "cls.predictions.decoder.bias": "cls.predictions.bias",
        }

    def inject_policy(self):
        return None if self.custom is None else (self.origin, self.custom)


class BertForMaskedLMPolicy(BertMLMPolicy):
    origin, custom = hf.BertForMaskedLM, VocabParallelBertForMaskedLM


class BertForPreTrainingPolicy(BertMLMPolicy):
    origin, custom = hf.BertForPreTraining, VocabParallelBertForPreTraining


class BertLMHeadModelPolicy(BertMLMPolicy):
    origin, custom = hf.BertLMHeadModel, None  # its loss_function is routed for every sharded model
