"""Sequence parallelism (``ShardConfig(sequence_parallel=True)``) against the unsharded model.

Every family at tp=2 and tp=4: outputs, loss, every gradient (the replicated norm weights included:
their gradients are sums over the ranks' chunks, the classic bug in this area) and weights after a
step. Sequence lengths that tp does not divide (ViT's 17 tokens, a 7-token prompt) are padded.
Dropout in the split region draws plain tp's masks; communication volume is plain tp's, plus one
all-gather per block where the column layers re-gather their inputs in backward (the default), which
keeps 1/tp of those inputs (checked with and without).
pp x tp x ZeRO with sequence parallelism runs in tests/pipeline/test_engine_from_plan.py.
"""

from collections import Counter

import pytest
import torch
import torch.distributed as dist
import transformers as tf

from shardformer import ShardConfig, shard_model
from shardformer.core.comm import CollectiveCounter
from shardformer.core.tiny import tiny_config
from shardformer.tools.pair_check import compare, load_pair
from tests.helpers import assert_close, assert_grads_match, check_table, saved_for_backward
from tests.policies import zoo
from tests.policies.test_parity import _as_full, parity


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
    """With dropout on, sequence parallelism computes what plain tp computes. Keeping the gathered
    block inputs (``sequence_parallel_regather=False``) it moves the same bytes inside the layers,
    plus one all-gather of the hidden states at each end of the region (the first layer's input,
    the final norm's output) and the norms' (and row biases') gradient sums; re-gathering them (the
    default) adds one all-gather per block, and the LM head re-gathers the final norm's output and
    reduce-scatters its input gradient instead of all-reducing it (the same bytes)."""
    name, world = "GPT2LMHeadModel", dist.get_world_size()
    config = _dropout_gpt2_config()
    _, plain = zoo.load_twice(name, config=config)
    plain = shard_model(plain, ShardConfig(tensor_parallel_size=world))
    inputs = zoo.inputs_for(name)
    loss_plain, plain_comm = _gpt2_step(plain, inputs)
    hidden = inputs["input_ids"].numel() * config.n_embd * 4  # bytes of [batch, seq, hidden] fp32
    share = (world - 1) / world
    for regather in (False, True):
        _, split = zoo.load_twice(name, config=config)
        split = shard_model(split, _sp(sequence_parallel_regather=regather))
        loss_split, split_comm = _gpt2_step(split, inputs)
        assert_close(loss_split, loss_plain, what=f"loss with dropout, regather={regather}")
        _same_local_grads(split, plain, f"with dropout, regather={regather}")
        norm_bytes = sum(4 * split.get_parameter(p).numel() for p in _split_params(split))
        blocks = 2 * config.n_layer if regather else 0  # attention and MLP re-gather their input in backward
        expected = plain_comm.wire_bytes(world) + (2 + blocks) * share * hidden + 2 * share * norm_bytes
        assert split_comm.wire_bytes(world) == pytest.approx(expected, rel=1e-9), (split_comm.counts, regather)
        head = 1 if regather else 0  # the head: re-gather + reduce-scatter in place of plain tp's all-reduce
        # attention and MLP, forward and backward, and the head's input gradient
        assert split_comm.counts["reduce_scatter"] == 4 * config.n_layer + head, (split_comm.counts, regather)
        # the region's ends, the blocks' inputs (forward) and the row layers' (backward), and the re-gathers
        assert split_comm.counts["all_gather"] == 2 + 4 * config.n_layer + blocks + head


def _held_bytes(model, inputs):
    """The loss and the bytes its forward saves for the backward."""
    return saved_for_backward(model, lambda: model(**inputs).loss)


def _regather_models(name):
    """(unsharded, keeping the gathered inputs, re-gathering them) of GPT-2 or a tp-plan Llama, same weights."""
    if name == "GPT2LMHeadModel":
        ref, keep = zoo.load_twice(name, "sdpa")
        _, again = zoo.load_twice(name, "sdpa")
        ids = zoo.inputs_for(name)["input_ids"][:, :8]
        layers, hidden = ref.config.n_layer, ref.config.n_embd
    else:
        config = tiny_config(tf.LlamaConfig, num_key_value_heads=4)
        ref, keep = load_pair(tf.LlamaForCausalLM, config, "sdpa")
        _, again = load_pair(tf.LlamaForCausalLM, config, "sdpa")
        ids = torch.randint(3, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(4))
        layers, hidden = config.num_hidden_layers, config.hidden_size
    keep = shard_model(keep, _sp(sequence_parallel_regather=False))
    again = shard_model(again, _sp())  # the default
    return ref, keep, again, {"input_ids": ids, "labels": ids}, layers, hidden


def check_regathered_inputs_are_exact_and_kept_as_chunks():
    """Re-gathering the column layers' inputs in backward computes what keeping them computes (and
    the unsharded model); the step saves 1/tp of each block's gathered input and of the LM head's
    (the final norm's output), and sends one more all-gather per block in backward; the head
    re-gathers its input too and reduce-scatters its input gradient instead of all-reducing it."""
    world = dist.get_world_size()
    for name in ("GPT2LMHeadModel", "LlamaForCausalLM"):
        ref, keep, again, inputs, layers, hidden = _regather_models(name)
        counts = {}
        for variant, model in (("keep", keep), ("regather", again)):
            model.zero_grad(set_to_none=True)
            with CollectiveCounter() as forward:
                loss, held = _held_bytes(model, inputs)
            with CollectiveCounter() as backward:
                loss.backward()
            counts[variant] = (loss.detach(), held, forward.counts, backward.counts)
        _same_local_grads(again, keep, f"{name}: re-gathered vs kept inputs")
        (loss_keep, held_keep, fwd_keep, bwd_keep), (loss_again, held_again, fwd_again, bwd_again) = counts.values()
        assert_close(loss_again, loss_keep, what=f"{name}: loss, re-gathered vs kept")
        blocks = 2 * layers  # attention and MLP
        assert fwd_again == fwd_keep, (name, fwd_again, fwd_keep)
        assert bwd_again - bwd_keep == Counter(all_gather=blocks + 1, reduce_scatter=1), (bwd_again, bwd_keep)
        assert bwd_keep - bwd_again == Counter(all_reduce=1), (bwd_again, bwd_keep)  # the head's, in plain tp
        chunk = inputs["input_ids"].numel() // world * hidden * 4  # 8 tokens: chunks of 8 / tp
        readers = blocks + 1  # the blocks' first linears and the head
        assert held_keep - held_again == readers * (world - 1) * chunk, (name, held_keep, held_again, chunk)
        again.zero_grad(set_to_none=True)
        odd = {k: v[:, :7] for k, v in inputs.items()}  # 7 tokens: the last chunk is padded
        parity(ref, again, odd, f"{name} sequence parallel, re-gathered inputs")


def check_returned_hidden_states_are_whole_and_carry_gradients():
    """The region ends after the final norm, whose chunk the LM head reads (re-gathered in backward):
    the hidden states the model returns are still the whole sequence (gathered where transformers
    recorded chunks), and a loss on them and on the logits gives the unsharded gradients, the
    head's (reduce-scattered into the chunk) and the hidden states' (replicated) summed right; a
    head reading a slice (``logits_to_keep``) runs as plain tp. 7 tokens: the last chunk is padded."""
    llama = tiny_config(tf.LlamaConfig, num_key_value_heads=4)
    pairs = {"GPT2LMHeadModel": zoo.load_twice("GPT2LMHeadModel", "sdpa"), "LlamaForCausalLM": None}
    pairs["LlamaForCausalLM"] = load_pair(tf.LlamaForCausalLM, llama, "sdpa")
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(3, 90, (2, 7), generator=g)
    for name, (ref, model) in pairs.items():
        model = shard_model(model, _sp())
        for keep in (0, 3):
            results = []
            for m in (ref, model):
                m.train().zero_grad(set_to_none=True)
                out = m(input_ids=ids, output_hidden_states=True, logits_to_keep=keep)
                logits = _as_full(out.logits, results[0][0] if results else out.logits)
                states = out.hidden_states
                weights = torch.Generator().manual_seed(7)
                loss = (torch.randn(logits.shape, generator=weights) * logits).sum()
                loss = loss + sum((torch.randn(h.shape, generator=weights) * h).sum() for h in states)
                loss.backward()
                results.append((logits.detach(), [h.detach() for h in states]))
            (ref_logits, ref_states), (logits, states) = results
            what = f"{name}, logits_to_keep={keep}"
            assert_close(logits, ref_logits, what=f"{what}: logits")
            assert len(states) == len(ref_states) == model.config.num_hidden_layers + 1, what
            for i, (h, r) in enumerate(zip(states, ref_states)):
                assert_close(h, r, what=f"{what}: hidden state {i}")
            assert_grads_match(model, ref)


def _same_local_grads(model, other, what):
    theirs = dict(other.named_parameters())
    for n, p in model.named_parameters():
        assert_close(p.grad, theirs[n].grad, 1e-5, 1e-4, f"grad of {n} {what}")


def _split_params(model):
    layer = [f"transformer.h.{i}." for i in range(len(model.transformer.h))]
    names = ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "attn.c_proj.bias", "mlp.c_proj.bias")
    return [p + n for p in layer for n in names] + ["transformer.ln_f.weight", "transformer.ln_f.bias"]


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
    # OPT flattens its hidden states to [tokens, hidden] before fc1: the route proof, run with sequence
    # parallelism, refuses it in shard_model (before the user's model is cut or runs), naming fc1
    _, opt = zoo.load_twice("OPTForCausalLM", config=tiny_config(tf.OPTConfig, ffn_dim=64))
    with pytest.raises(ValueError, match=r"(?s)fc1 expected .*sequence_parallel=False") as refused:
        shard_model(opt, _sp())
    assert "no route shards OPTForCausalLM" in str(refused.value), refused.value
    assert "shardformer" not in vars(opt) and opt.model.decoder.layers[0].fc1.weight.shape == (64, 32)  # untouched
    _, gpt2 = zoo.load_twice("GPT2LMHeadModel", "sdpa")
    gpt2 = shard_model(gpt2, _sp())
    base, ids = gpt2.transformer, zoo.inputs_for("GPT2LMHeadModel")["input_ids"]

    def skips_final_norm(input_ids=None, **_):  # a forward that never reaches ln_f, which ends the region
        hidden = base.wte(input_ids) + base.wpe(torch.arange(input_ids.shape[1]))
        for block in base.h:
            hidden = block(hidden)
        return tf.modeling_outputs.BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=hidden)

    base.forward = skips_final_norm
    with pytest.raises(RuntimeError, match="ran its last layer but not its final norm"):
        gpt2(input_ids=ids)


TP2 = [
    check_gpt2_lm_and_generate,
    check_bert_mlm,
    check_vit_classifier_pads_17_tokens,
    check_timm_vit,
    check_llama_and_qwen3_from_plans,
    check_dropout_masks_and_communication_volume_are_plain_tps,
    check_regathered_inputs_are_exact_and_kept_as_chunks,
    check_returned_hidden_states_are_whole_and_carry_gradients,
    check_activation_checkpointing_replays_split_dropout,
    check_refusals_name_the_fix,
]
TP4 = [  # 17 ViT tokens in chunks of 5, 5, 5, 2; a 7-token prompt in chunks of 2, 2, 2, 1
    check_gpt2_lm_and_generate,
    check_bert_mlm,
    check_vit_classifier_pads_17_tokens,
    check_timm_vit,
    check_llama_and_qwen3_from_plans,
    check_regathered_inputs_are_exact_and_kept_as_chunks,
    check_returned_hidden_states_are_whole_and_carry_gradients,
]
test_tp2 = check_table(TP2, 2)
test_tp4 = check_table(TP4, 4)


def test_flag_is_checked():
    with pytest.raises(ValueError, match="sequence_parallel='yes'"):
        ShardConfig(sequence_parallel="yes")
