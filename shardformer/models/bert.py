"""BERT: separate query/key/value Linears, vocab-parallel MLM decoder tied to the word embeddings.

The family record: policies, the layer stack ``encoder.layer``, BertForMaskedLM's pipeline split and
stage forward, the heads that compute their loss inline, and the tiny / named builds."""

from __future__ import annotations

import torch.nn.functional as F
import transformers as tf
from transformers.models.bert import modeling_bert as hf

from shardformer.models import ModelFamily
from shardformer.models.tiny import tiny_config
from shardformer.pipeline.spec import PipelineSpec, stage_of
from shardformer.pipeline.stage_view import Returns, own_forward, stage_view
from shardformer.tensor_parallel.layers import VocabParallelEmbedding1D, VocabParallelLMHead1D
from shardformer.tensor_parallel.layers.attention_dropout import attention_dropout_rng
from shardformer.tensor_parallel.lm_head import forward_like, token_loss, with_loss
from shardformer.tensor_parallel.policy import Argument, Col_Layer, Dropout_Layer, Layer, Policy, Row_Layer, divide


class VocabParallelBertForMaskedLM(hf.BertForMaskedLM):
    @forward_like(hf.BertForMaskedLM.forward)
    def forward(self, labels=None, return_dict=None, **kwargs):
        output = super().forward(return_dict=True, **kwargs)
        loss = None if labels is None else token_loss(output.logits, labels, self.cls.predictions.decoder)
        return with_loss(output, loss, return_dict)


class VocabParallelBertForPreTraining(hf.BertForPreTraining):
    @forward_like(hf.BertForPreTraining.forward)
    def forward(self, labels=None, next_sentence_label=None, return_dict=None, **kwargs):
        output = super().forward(return_dict=True, **kwargs)
        loss = None
        if labels is not None and next_sentence_label is not None:  # as transformers: both or no loss
            mlm = token_loss(output.prediction_logits, labels, self.cls.predictions.decoder)
            nsp = F.cross_entropy(output.seq_relationship_logits.view(-1, 2), next_sentence_label.view(-1))
            loss = mlm + nsp
        return with_loss(output, loss, return_dict)


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
            # eager/sdpa attention read only dropout.p: the per-rank stream around the attention
            Layer("attention.self", replace_layer=attention_dropout_rng("dropout.p")),
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


def bert_mlm_stage_forward(model, hidden, inputs):
    """One pipeline stage of BertForMaskedLM on a micro-batch: BERT's own forward (the whole model's on
    the last stage, head and loss included), its embeddings answering with the received hidden states
    after the first stage; the attention mask is built as BertModel builds it, on every stage."""
    stage, num_stages = stage_of(model)
    feed = {
        k: inputs[k]
        for k in ("input_ids", "inputs_embeds", "attention_mask", "token_type_ids", "position_ids")
        if inputs.get(k) is not None
    }
    with stage_view(model, {} if stage == 0 else {"bert.embeddings": Returns(hidden)}):
        if stage < num_stages - 1:
            return model.bert(**feed).last_hidden_state
        return own_forward(model)(**feed, labels=inputs.get("labels"))


FAMILY = ModelFamily(
    name="BERT",
    policies={
        **dict.fromkeys(
            (
                "BertModel",
                "BertForNextSentencePrediction",
                "BertForSequenceClassification",
                "BertForMultipleChoice",
                "BertForTokenClassification",
                "BertForQuestionAnswering",
            ),
            BertPolicy,
        ),
        "BertForMaskedLM": BertForMaskedLMPolicy,
        "BertForPreTraining": BertForPreTrainingPolicy,
        "BertLMHeadModel": BertLMHeadModelPolicy,
    },
    layers="encoder.layer",
    pipelines={
        # word embeddings are tied to the MLM decoder: on both end stages
        "BertForMaskedLM": PipelineSpec(
            layers="bert.encoder.layer",
            stage_forward=bert_mlm_stage_forward,
            first=tuple(f"bert.embeddings.{n}" for n in ("position_embeddings", "token_type_embeddings", "LayerNorm")),
            last=("cls", "bert.pooler"),
            shared=("bert.embeddings.word_embeddings",),
        ),
    },
    builds={
        "bert-tiny": lambda: tf.BertForMaskedLM(tiny_config(tf.BertConfig, max_position_embeddings=32)),
        "bert-base": lambda: tf.BertForMaskedLM(tf.BertConfig()),
        "bert-large": lambda: tf.BertForMaskedLM(
            tf.BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
        ),
    },
)
