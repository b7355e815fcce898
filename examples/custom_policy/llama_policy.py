"""A custom Policy: tensor-parallel Llama, a model shardformer has no built-in policy for.

Check it against the unsharded model (outputs, loss, gradients, a step, generate), from this folder:

    shardformer verify llama_policy:tiny_llama --policy llama_policy:LlamaPolicy

Run it on 2 processes to compare the sharded model's logits with the original:

    shardformer run --nproc_per_node 2 examples/custom_policy/llama_policy.py
"""

import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama as llama

from shardformer import Argument, Col_Layer, Policy, Row_Layer, ShardConfig, init_distributed, shard_model
from shardformer.policies import divide
from shardformer.tensor_parallel.layers import (
    VocabParallelEmbedding1D,
    VocabParallelLMHead1D,
    vocab_parallel_cross_entropy,
)


class LlamaPolicy(Policy):
    """Megatron-style Llama: q/k/v and gate/up split by output, o/down by input, vocabulary split."""

    def argument_policy(self, config, shard_config):
        tp = shard_config.tensor_parallel_size
        divide(config.num_attention_heads, tp, "num_attention_heads")  # clear errors before anything runs
        divide(config.num_key_value_heads, tp, "num_key_value_heads")
        divide(config.intermediate_size, tp, "intermediate_size")
        # LlamaAttention views its projections as (-1, head_dim): no attribute needs a per-rank value.
        # (A forward reading self.num_heads would need {"self_attn.num_heads": heads // tp} here; the
        # sharder rewrites such head counts itself and refuses widths left at their full size.)
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
        # logits stay vocab-parallel (no rank holds full-vocabulary logits): the loss below reads them;
        # generate() gathers them on its own
        return [Col_Layer("lm_head", bias=None, replace_layer=VocabParallelLMHead1D)]

    def inject_policy(self):
        return llama.LlamaForCausalLM, VocabParallelLlamaForCausalLM

    def binding_policy(self):
        # optional: the sharder finds ties in the model itself (one tensor under two names)
        return {"model.embed_tokens.weight": "lm_head.weight"}


class VocabParallelLlamaForCausalLM(llama.LlamaForCausalLM):
    """LlamaForCausalLM whose loss runs on vocab-parallel logits ``[..., vocab / tp]``."""

    @property
    def loss_function(self):
        head = self.lm_head  # a VocabParallelLMHead1D: its process_group is the tensor-parallel group

        def causal_lm_loss(logits, labels, vocab_size=None, ignore_index=-100, **_):
            shifted = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]  # token t predicts token t + 1
            return vocab_parallel_cross_entropy(logits, shifted, head.process_group, head.vocab_size, ignore_index)

        return causal_lm_loss


def tiny_llama_config(**kw):
    return LlamaConfig(
        vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, **kw,
    )  # fmt: skip


def tiny_llama():
    """A factory for ``shardformer verify`` (random weights)."""
    return LlamaForCausalLM(tiny_llama_config())


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
    loss, ref_loss = model(ids, labels=ids).loss, ref(ids, labels=ids).loss
    diff = abs(loss.item() - ref_loss.item())
    if dist.get_rank() == 0:
        print(f"|loss - unsharded loss| = {diff:.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
