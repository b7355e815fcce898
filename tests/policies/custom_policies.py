"""Custom policies written as a new user would (importable, so spawned ranks can load them by name)."""

import torch
import transformers as tf
from transformers.models.gpt2 import modeling_gpt2 as gpt2
from transformers.models.llama import modeling_llama as llama
from transformers.models.opt import modeling_opt as opt

from examples.custom_policy.llama_policy import LlamaPolicy, tiny_llama_config
from shardformer import Argument, Col_Layer, Policy, Row_Layer
from shardformer.models.gpt2 import GPT2LMHeadPolicy
from shardformer.tensor_parallel.layers import VocabParallelEmbedding1D, VocabParallelLMHead1D


class OPTPolicy(Policy):
    """OPT with no attr_dict and no binding_policy: its attention reads self.num_heads (trap 1) and
    its lm_head is tied to embed_tokens (trap 5); the sharder must get both right by itself."""

    def argument_policy(self, config, shard_config):
        layer = [
            lambda: [Col_Layer(f"self_attn.{p}_proj") for p in "qkv"],
            lambda: [Row_Layer("self_attn.out_proj"), Col_Layer("fc1"), Row_Layer("fc2")],
        ]
        return {
            opt.OPTDecoderLayer: Argument({}, layer),
            opt.OPTDecoder: Argument(
                {}, [lambda: [Col_Layer("embed_tokens", bias=None, replace_layer=VocabParallelEmbedding1D)]]
            ),
            opt.OPTForCausalLM: Argument(
                {}, [lambda: [Col_Layer("lm_head", bias=None, gather_output=True, replace_layer=VocabParallelLMHead1D)]]
            ),
        }


def tiny_opt(dropout=0.0):
    torch.manual_seed(0)
    config = tf.OPTConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=32, dropout=dropout, attention_dropout=0.0,
        pad_token_id=1, bos_token_id=2, eos_token_id=2,
    )  # fmt: skip
    return tf.OPTForCausalLM(config)


class BrokenGPT2Policy(GPT2LMHeadPolicy):
    """c_attn cut as one block instead of Q, K and V each (n_cast=1): runs, and is wrong."""

    @staticmethod
    def attn_in():
        return [Col_Layer("attn.c_attn", reversed=True)]


class GPT2WithoutAttrsPolicy(GPT2LMHeadPolicy):
    """The GPT-2 policy without its attr_dict: split_size (a width the forward reads) stays full."""

    def argument_policy(self, config, shard_config):
        arguments = super().argument_policy(config, shard_config)
        arguments[gpt2.GPT2Block] = Argument({}, arguments[gpt2.GPT2Block].param_funcs)
        return arguments


class UncheckedLlamaPolicy(LlamaPolicy):
    """The example's layers without its own divide() calls and without binding_policy."""

    def argument_policy(self, config, shard_config):
        layers = [self.attn_in, self.attn_out, self.mlp_in, self.mlp_out]
        return {
            llama.LlamaDecoderLayer: Argument({}, layers),
            llama.LlamaModel: Argument({}, [self.embedding]),
            llama.LlamaForCausalLM: Argument({}, [self.unembedding]),
        }

    def binding_policy(self):
        return None


class LlamaWithModelsOwnLossPolicy(LlamaPolicy):
    """The example without its injected loss: transformers' own loss meets vocab-parallel logits (trap 8)."""

    def inject_policy(self):
        return None


def tiny_llama(**overrides):
    torch.manual_seed(0)
    config = tiny_llama_config()
    for key, value in overrides.items():
        setattr(config, key, value)
    return tf.LlamaForCausalLM(config)
