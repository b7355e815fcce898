"""Sequence parallelism (``ShardConfig(sequence_parallel=True)``) against the unsharded model.

Every family at tp=2 and tp=4: outputs, loss, every gradient (the replicated norm weights included:
their gradients are sums over the ranks' chunks, the classic bug in this area) and weights after a
step. Sequence lengths that tp does not divide (ViT's 17 tokens, a 7-token prompt) are padded.
Dropout in the split region draws plain tp's masks; communication volume is plain tp's.
pp x tp x ZeRO with sequence parallelism runs in tests/pipeline/test_engine_from_plan.py.
"""

import pytest
import torch
import torch.distributed as dist
import transformers as tf

from shardformer import ShardConfig, shard_model
from shardformer.core.comm import CollectiveCounter
from shardformer.models.tiny import tiny_config
from shardformer.tools.conformance import compare, load_pair
from tests.helpers import assert_close, check_table
from tests.policies import zoo
from tests.policies.test_parity import parity


def _dropout_gpt2_config():
    config = zoo.gpt2_config()
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.1
    return config


def _sp(**kw):
    return ShardConfig(tensor_parallel_size=dist.get_world_size(), sequence_parallel=True, **kw)


def _hf(name, impl="eager"):
    ref, model = zoo.load_twice(name, impl)
    model = shard_model(model, _sp())
    with CollectiveCounter() as counter:
        parity(ref, model, zoo.inputs_for(name), f"{name}/{impl} sequence parallel")
    assert counter.counts["reduce_scatter"] > 0, f"{name}: sequence parallelism did not run: {counter.counts}"


def check_gpt2_lm_and_generate():
    _hf("GPT2LMHeadModel", "sdpa")  # attention runs on the whole sequence: eager and sdpa alike
    ref, model = zoo.load_twice("GPT2LMHeadModel", "sdpa")
    model = shard_model(model, _sp()).eval()
    prompt = zoo.inputs_for("GPT2LMHeadModel")["input_ids"][:, :7]  # 7 tokens: padded prefill
    kwargs = {"max_new_tokens": 6, "do_sample": False, "use_cache": True, "pad_token_id": 0}
    with CollectiveCounter() as counter:
        got = model.generate(prompt, **kwargs)  # decode steps of one token run as plain tp
    assert torch.equal(got, ref.eval().generate(prompt, **kwargs))
    assert counter.counts["reduce_scatter"] > 0


def check_bert_mlm():
    _hf("BertForMaskedLM", "sdpa")


def check_vit_classifier_pads_17_tokens():
    _hf("ViTForImageClassification", "eager")


def check_timm_vit():
    ref, model = zoo.timm_pair()
    model = shard_model(model, _sp())
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    parity(ref, model, {"x": pixels}, "timm VisionTransformer sequence parallel")


def check_llama_and_qwen3_from_plans():
    for name, impl in (("LlamaForCausalLM", "sdpa"), ("Qwen3ForCausalLM", "eager")):
        cls = getattr(tf, name)
        config = tiny_config(cls.config_class, num_key_value_heads=4)  # tp=4 splits them too
        result = compare(cls, config, impl, seq=7, new_tokens=4, sequence_parallel=True)
        assert not result.failures, f"{name}/{impl}: {result.failures}"


def _gpt2_step(model, inputs, seed=0):
    model.train()
    torch.manual_seed(seed)
    with CollectiveCounter() as counter:
        loss = model(**inputs).loss
        loss.backward()
    return loss.detach(), counter


def check_dropout_masks_and_communication_volume_are_plain_tps():
    """With dropout on, sequence parallelism computes what plain tp computes; it moves the same
    bytes inside the layers, plus one all-gather of the hidden states at each end of the stack and
    the norms' (and row biases') gradient sums."""
    name, world = "GPT2LMHeadModel", dist.get_world_size()
    config = _dropout_gpt2_config()
    _, plain = zoo.load_twice(name, config=config)
    _, split = zoo.load_twice(name, config=config)
    plain = shard_model(plain, ShardConfig(tensor_parallel_size=world))
    split = shard_model(split, _sp())
    inputs = zoo.inputs_for(name)
    loss_plain, plain_comm = _gpt2_step(plain, inputs)
    loss_split, split_comm = _gpt2_step(split, inputs)
    assert_close(loss_split, loss_plain, what="loss with dropout")
    _same_local_grads(split, plain, "with dropout")
    hidden = inputs["input_ids"].numel() * config.n_embd * 4  # bytes of [batch, seq, hidden] fp32
    share = (world - 1) / world
    norm_bytes = sum(4 * split.get_parameter(p).numel() for p in _split_params(split))
    expected = plain_comm.wire_bytes(world) + 2 * share * hidden + 2 * share * norm_bytes
    assert split_comm.wire_bytes(world) == pytest.approx(expected, rel=1e-9), (split_comm.counts, plain_comm.counts)
    assert split_comm.counts["reduce_scatter"] == 4 * config.n_layer  # attention and MLP, forward and backward


def _same_local_grads(model, other, what):
    theirs = dict(other.named_parameters())
    for n, p in model.named_parameters():
        assert_close(p.grad, theirs[n].grad, 1e-5, 1e-4, f"grad of {n} {what}")


def _split_params(model):
    layer = [f"transformer.h.{i}." for i in range(len(model.transformer.h))]
    names = ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "attn.c_proj.bias", "mlp.c_proj.bias")
    return [p + n for p in layer for n in names]


def check_activation_checkpointing_replays_split_dropout():
    name = "GPT2LMHeadModel"
    config = _dropout_gpt2_config()
    _, a = zoo.load_twice(name, config=config)
    _, b = zoo.load_twice(name, config=config)
    a, b = shard_model(a, _sp()), shard_model(b, _sp())
    b.gradient_checkpointing_enable()
    inputs = zoo.inputs_for(name)
    loss_a, _ = _gpt2_step(a, inputs)
    loss_b, _ = _gpt2_step(b, inputs)
    assert_close(loss_b, loss_a, what="loss with checkpointing")
    _same_local_grads(b, a, "with checkpointing")
    ref, model = zoo.load_twice(name)
    model = shard_model(model, _sp())
    model.gradient_checkpointing_enable()
    parity(ref, model, zoo.inputs_for(name), "GPT-2 sequence parallel + activation checkpointing")


def check_refusals_name_the_fix():
    cls = tf.MixtralForCausalLM
    _, model = load_pair(cls, tiny_config(cls.config_class))
    try:
        shard_model(model, _sp())
    except ValueError as e:
        assert "experts" in str(e) and "sequence_parallel=False" in str(e), e
    else:
        raise AssertionError("a mixture of experts was sharded with sequence parallelism")


TP2 = [
    check_gpt2_lm_and_generate,
    check_bert_mlm,
    check_vit_classifier_pads_17_tokens,
    check_timm_vit,
    check_llama_and_qwen3_from_plans,
    check_dropout_masks_and_communication_volume_are_plain_tps,
    check_activation_checkpointing_replays_split_dropout,
    check_refusals_name_the_fix,
]
TP4 = [  # 17 ViT tokens in chunks of 5, 5, 5, 2; a 7-token prompt in chunks of 2, 2, 2, 1
    check_gpt2_lm_and_generate,
    check_bert_mlm,
    check_vit_classifier_pads_17_tokens,
    check_timm_vit,
    check_llama_and_qwen3_from_plans,
]
test_tp2 = check_table(TP2, 2)
test_tp4 = check_table(TP4, 4)


def test_flag_is_checked():
    with pytest.raises(ValueError, match="sequence_parallel='yes'"):
        ShardConfig(sequence_parallel="yes")
