"""A custom Policy: tensor-parallel Llama, a model shardformer has no built-in policy for.

Run it on 2 processes to compare the sharded model with the original:

    shardformer run --nproc_per_node 2 examples/custom_policy/llama_policy.py
"""

import tempfile

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama as llama

from shardformer import Argument, Col_Layer, Policy, Row_Layer, ShardConfig, init_distributed, shard_model
from shardformer.layers import VocabParallelEmbedding1D, VocabParallelLMHead1D
from shardformer.policies import divide


class LlamaPolicy(Policy):
    """Megatron-style Llama: q/k/v and gate/up split by output, o/down by input, vocabulary split."""

    def argument_policy(self, config, shard_config):
        tp = shard_config.tensor_parallel_size
        divide(config.num_attention_heads, tp, "num_attention_heads")  # clear errors before anything runs
        divide(config.num_key_value_heads, tp, "num_key_value_heads")
        divide(config.intermediate_size, tp, "intermediate_size")
        # LlamaAttention views its projections as (-1, head_dim): no attribute needs a per-rank value.
        return {
            llama.LlamaDecoderLayer: Argument({}, [self.attn_in, self.attn_out, self.mlp_in, self.mlp_out]),
            llama.LlamaModel: Argument({}, [self.embedding]),
            llama.LlamaForCausalLM: Argument({}, [self.unembedding]),
        }

    @staticmethod
    def attn_in():
        return [Col_Layer("self_attn.q_proj"), Col_Layer("self_attn.k_proj"), Col_Layer("self_attn.v_proj")]

    @staticmethod
    def attn_out():
        return [Row_Layer("self_attn.o_proj")]

    @staticmethod
    def mlp_in():
        return [Col_Layer("mlp.gate_proj"), Col_Layer("mlp.up_proj")]

    @staticmethod
    def mlp_out():
        return [Row_Layer("mlp.down_proj")]

    @staticmethod
    def embedding():
        return [Col_Layer("embed_tokens", bias=None, replace_layer=VocabParallelEmbedding1D)]

    @staticmethod
    def unembedding():
        # gather_output: the model's own loss and generate() see full-vocabulary logits
        return [Col_Layer("lm_head", bias=None, gather_output=True, replace_layer=VocabParallelLMHead1D)]

    def binding_policy(self):
        return {"model.embed_tokens.weight": "lm_head.weight"}  # kept tied only if tied in the model


def tiny_llama_config(**kw):
    return LlamaConfig(
        vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, **kw,
    )  # fmt: skip


def main():
    init_distributed()
    box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        LlamaForCausalLM(tiny_llama_config()).save_pretrained(box[0])
    dist.barrier()
    ref = LlamaForCausalLM.from_pretrained(box[0])
    model = shard_model(
        LlamaForCausalLM.from_pretrained(box[0]),
        ShardConfig(tensor_parallel_size=dist.get_world_size()),
        policy=LlamaPolicy(),
    )
    ids = torch.randint(0, 99, (2, 16), generator=torch.Generator().manual_seed(1))
    diff = (model(ids).logits - ref(ids).logits).abs().max().item()
    if dist.get_rank() == 0:
        print(f"max |logits - unsharded logits| = {diff:.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
