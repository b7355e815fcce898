"""BERT: separate query/key/value Linears, vocab-parallel MLM decoder tied to the word embeddings."""

from __future__ import annotations

from functools import partial

import torch.nn.functional as F
from transformers.modeling_outputs import MaskedLMOutput
from transformers.models.bert import modeling_bert as hf

from shardformer.layers import VocabParallelEmbedding1D, VocabParallelLMHead1D
from shardformer.policies.base import Argument, Col_Layer, Dropout_Layer, Policy, Row_Layer, divide
from shardformer.policies.lm_heads import causal_lm_loss, gathered_logits, token_loss, with_loss


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
        return self.origin, self.custom


def bert_mlm_stage_forward(model, hidden, inputs):
    """One pipeline stage of BertForMaskedLM on a micro-batch."""
    from shardformer.pipeline.split import local_layers

    b = model.bert
    stage, num_stages = getattr(model, "shardformer_stage", (0, 1))
    if stage == 0:
        hidden = b.embeddings(
            input_ids=inputs.get("input_ids"),
            token_type_ids=inputs.get("token_type_ids"),
            position_ids=inputs.get("position_ids"),
        )
    mask, _ = b._create_attention_masks(
        attention_mask=inputs.get("attention_mask"),
        encoder_attention_mask=None,
        embedding_output=hidden,
        encoder_hidden_states=None,
        past_key_values=None,
    )
    for layer in local_layers(model, b.encoder.layer):
        hidden = layer(hidden, mask)
    if stage < num_stages - 1:
        return hidden
    logits = model.cls(hidden)
    labels = inputs.get("labels")
    loss = None if labels is None else token_loss(logits, labels, model.cls.predictions.decoder)
    return MaskedLMOutput(loss=loss, logits=logits)


class VocabParallelBertForMaskedLM(hf.BertForMaskedLM):
    def forward(self, *args, labels=None, return_dict=None, **kwargs):
        output = super().forward(*args, return_dict=True, **kwargs)
        loss = None if labels is None else token_loss(output.logits, labels, self.cls.predictions.decoder)
        return with_loss(output, loss, return_dict)


class VocabParallelBertForPreTraining(hf.BertForPreTraining):
    def forward(self, *args, labels=None, next_sentence_label=None, return_dict=None, **kwargs):
        output = super().forward(*args, return_dict=True, **kwargs)
        loss = None
        if labels is not None and next_sentence_label is not None:  # as transformers: both or no loss
            mlm = token_loss(output.prediction_logits, labels, self.cls.predictions.decoder)
            nsp = F.cross_entropy(output.seq_relationship_logits.view(-1, 2), next_sentence_label.view(-1))
            loss = mlm + nsp
        return with_loss(output, loss, return_dict)


class VocabParallelBertLMHeadModel(hf.BertLMHeadModel):
    @property
    def loss_function(self):
        return partial(causal_lm_loss, head=self.cls.predictions.decoder)

    def generate(self, *args, **kwargs):
        with gathered_logits(self.cls.predictions.decoder):
            return super().generate(*args, **kwargs)


class BertForMaskedLMPolicy(BertMLMPolicy):
    origin, custom = hf.BertForMaskedLM, VocabParallelBertForMaskedLM

    # pipeline: embeddings on the first stage, the MLM head on the last; word embeddings (tied to
    # the decoder) on both
    def pipeline_layers(self, model):
        return "bert.encoder.layer"

    def pipeline_first(self, model):
        return [f"bert.embeddings.{n}" for n in ("position_embeddings", "token_type_embeddings", "LayerNorm")]

    def pipeline_last(self, model):
        return ["cls", "bert.pooler"]

    def pipeline_shared(self, model):
        return ["bert.embeddings.word_embeddings"]

    def stage_forward(self, model, hidden, inputs):
        return bert_mlm_stage_forward(model, hidden, inputs)


class BertForPreTrainingPolicy(BertMLMPolicy):
    origin, custom = hf.BertForPreTraining, VocabParallelBertForPreTraining


class BertLMHeadModelPolicy(BertMLMPolicy):
    origin, custom = hf.BertLMHeadModel, VocabParallelBertLMHeadModel
