"""The sharder reads ties, head counts and widths from the model (issue 14, traps 1, 5, 7, 9).

Every refusal here happens in ModelSharder.plan: the tensor-parallel group is a VirtualGroup and
torch.distributed is not even initialised, so no collective could have been issued.
"""

import pytest
import torch.distributed as dist
import transformers as tf

from shardformer import Argument, ShardConfig, shard_model
from shardformer.cli.main import main
from shardformer.core.comm import VirtualGroup
from shardformer.tensor_parallel.detect import PolicyMismatch, _sizes_that_cut
from tests.policies.custom_policies import (
    GPT2WithoutAttrsPolicy,
    OPTPolicy,
    UncheckedLlamaPolicy,
    tiny_llama,
    tiny_opt,
)


def planned(tp=2):
    return ShardConfig(tensor_parallel_process_group=VirtualGroup(0, tp))


def refused(model, policy, tp=2) -> str:
    with pytest.raises(PolicyMismatch) as info:
        shard_model(model, planned(tp), policy)
    assert not dist.is_initialized()
    return str(info.value)


def test_head_count_read_in_forward_is_made_per_rank():  # trap 1: OPTAttention views q with self.num_heads
    model = shard_model(tiny_opt(), planned(), OPTPolicy())
    assert all(layer.self_attn.num_heads == 2 for layer in model.model.decoder.layers)


def test_width_read_in_forward_left_full_is_refused_by_name():  # trap 1, a width: the fix is named
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=99))
    message = refused(gpt2, GPT2WithoutAttrsPolicy())
    assert "transformer.h.0.attn.split_size = 32" in message
    assert 'add "attn.split_size": 16 to the attr_dict of GPT2Block' in message


def test_a_layer_index_equal_to_a_width_is_no_width():  # Dots3Note: layer 2, a gate of 2 outputs
    opt = tiny_opt()
    opt.model.decoder.layers[1].self_attn.layer_idx = 32  # q_proj's width, read in forward by the cache
    model = shard_model(opt, planned(), OPTPolicy())
    assert model.model.decoder.layers[1].self_attn.layer_idx == 32


def test_ties_found_in_the_model_stay_tied():  # trap 5: neither policy has a binding_policy
    opt = shard_model(tiny_opt(), planned(), OPTPolicy())
    assert opt.lm_head.weight is opt.model.decoder.embed_tokens.weight
    llama = shard_model(tiny_llama(), planned(), UncheckedLlamaPolicy())
    assert llama.lm_head.weight is llama.model.embed_tokens.weight
    assert llama.lm_head.weight.shape == (50, 32)  # the vocab-parallel shard, padded 99 -> 100


def test_tie_cut_on_one_side_only_is_refused():
    class EmbeddingOnly(UncheckedLlamaPolicy):
        def argument_policy(self, config, shard_config):
            arguments = super().argument_policy(config, shard_config)
            arguments[tf.LlamaForCausalLM] = Argument({}, [])
            return arguments

    message = refused(tiny_llama(), EmbeddingOnly())
    assert "model.embed_tokens.weight and lm_head.weight are one tied tensor" in message


def test_kv_heads_tp_does_not_divide_are_refused():  # trap 7: the policy never called divide()
    message = refused(tiny_llama(num_key_value_heads=1), UncheckedLlamaPolicy())
    assert "model.layers.0.self_attn.k_proj (Linear) holds num_key_value_heads=1 heads of 8" in message


def test_width_tp_does_not_divide_is_refused():
    message = refused(tiny_llama(intermediate_size=66, num_key_value_heads=4), UncheckedLlamaPolicy(), tp=4)
    assert (
        "model.layers.0.mlp.gate_proj (Linear): its output width 66 does not divide by tensor_parallel_size=4; "
        "a tensor_parallel_size of 2, 3, 6, 11, 22 or 33 divides it; or train it with data parallelism and ZeRO"
        in message
    )
    # Perceiver's 3 + 258 Fourier features: no even size divides them; a prime width: no size at all
    assert _sizes_that_cut(261).startswith("a tensor_parallel_size of 3, 9 or 29 divides it; or train it")
    assert _sizes_that_cut(67).startswith("no tensor_parallel_size up to 64 divides it; or train it")


def test_plan_takes_a_custom_policy_and_a_model_class(tmp_path, capsys, monkeypatch):  # trap 9
    from examples.custom_policy.llama_policy import tiny_llama_config

    tiny_llama_config().save_pretrained(tmp_path)  # a config without `architectures`
    assert main(["plan", str(tmp_path), "--tp", "2"]) == 2
    assert "no 'architectures'; name the model class with --model-class" in capsys.readouterr().err
    # no built-in policy: the one derived from Llama's own tp plan (issue 13), or a custom one
    assert main(["plan", str(tmp_path), "--model-class", "LlamaForCausalLM", "--tp", "2"]) == 0
    assert "LlamaForCausalLM -> VocabParallelLlamaForCausalLM" in capsys.readouterr().out
    policy = "examples.custom_policy.llama_policy:LlamaPolicy"
    assert main(["plan", str(tmp_path), "--model-class", "LlamaForCausalLM", "--policy", policy, "--tp", "2"]) == 0
    assert "Linear -> VocabParallelLMHead1D: 1 (e.g. lm_head)" in capsys.readouterr().out


def test_tiny_copies_keep_special_tokens_apart_and_rotary_sections_whole():
    """A multimodal config's image, video and vision-start tokens (ids beyond the tiny vocabulary) stay
    distinct tokens in the tiny copy, and its rotary sections (Qwen2-VL's time, height, width) fit the
    tiny head; a tower's width holds its heads."""
    import transformers

    from shardformer.core.tiny import VOCAB, tiny_copy_config
    from shardformer.core.tiny_rotary import rotary_sections

    config = transformers.Qwen2_5_VLConfig()
    config.text_config.rope_parameters["mrope_section"] = [16, 24, 24]
    tiny = tiny_copy_config(config, tp=2)
    ids = [tiny.image_token_id, tiny.video_token_id, tiny.vision_start_token_id, tiny.vision_end_token_id]
    assert len(set(ids)) == 4 and all(0 <= i < VOCAB for i in ids), ids
    head = tiny.text_config.hidden_size // tiny.text_config.num_attention_heads
    assert sum(tiny.text_config.rope_parameters["mrope_section"]) == head // 2
    vision = tiny_copy_config(transformers.Qwen2VLConfig(), tp=2).vision_config
    assert vision.embed_dim % vision.num_heads == 0, (vision.embed_dim, vision.num_heads)
    assert rotary_sections([16, 24, 24], 4) == [2, 1, 1] and rotary_sections([1, 2, 1], 2) == [0, 2, 0]
    # equal sections stay equal (Ernie 4.5 VL stacks height and width) where the head has room
    assert rotary_sections([22, 22, 20], 4) == [1, 1, 2] and rotary_sections([16, 24, 24], 2) == [0, 1, 1]


def test_a_tie_a_route_cuts_on_one_side_is_closed():
    """An LM head tied to a token embedding the route left whole (BERT2BERT's and T5Gemma's decoder
    embedding): the vocabulary is split in both. Another half-cut tie is kept whole; a gradient hook
    on a tied table (UDOP's relative position table) cuts nothing. (Both models' rows in the verify
    sweep prove the cut exact.)"""
    import torch.nn as nn

    from shardformer.policies.tp_plan.styles import GradAllReduce
    from shardformer.policies.tp_plan.ties import cut_ties_alike
    from shardformer.tensor_parallel.layers import VocabParallelEmbedding1D, VocabParallelLMHead1D
    from shardformer.tensor_parallel.policy import Col_Layer, Layer

    model = nn.ModuleDict(
        dict(
            embed=nn.Embedding(10, 4), head=nn.Linear(4, 10, bias=False), table=nn.Embedding(6, 4), proj=nn.Linear(4, 6)
        )
    )
    model.head.weight = model.embed.weight
    model.proj.weight = model.table.weight
    layers = {"head": Col_Layer("head", replace_layer=VocabParallelLMHead1D), "proj": Col_Layer("proj")}
    cut_ties_alike(model, layers)
    assert layers["embed"].replace_layer is VocabParallelEmbedding1D and "head" in layers
    assert "proj" not in layers and "table" not in layers
    hooked = {"table": Layer("table", replace_layer=GradAllReduce)}
    cut_ties_alike(model, hooked)
    assert list(hooked) == ["table"]
