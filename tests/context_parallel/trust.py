"""Context parallelism where a split could silently differ from the whole sequence: left padding
(query rows that see no key), positions the model derives itself (RoBERTa from its ids, OPT from the
mask), dynamic-NTK rotary, Phi-3 (attention modules with their own config copy), generate without a
cache, dropout masks per cp rank, and instances whose additions read the sequence's index or length
(refused by the proof before any cut). Checks run in test_parity.py's spawn."""

import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers as tf

from shardformer import ShardConfig, shard_model, sharding_of
from shardformer.core.tiny import tiny_config
from shardformer.policies.derived import NotProvenError
from shardformer.tensor_parallel.layers.dropout import SeededDropout
from shardformer.tools.pair_check import load_pair
from tests.context_parallel import common


def _cp(mode="ring", **kw):
    return ShardConfig(context_parallel_size=dist.get_world_size(), context_parallel_mode=mode, **kw)


def left_padded(seq, rows=2, pad=0, seed=3):
    """The first row starts with 4 padding tokens: their query rows see no key at all."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, common.VOCAB, (rows, seq), generator=g)
    mask = torch.ones(rows, seq, dtype=torch.long)
    mask[0, :4], ids[0, :4] = 0, pad
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _parity(cls, config, impl, mode, inputs, what):
    ref, model = load_pair(cls, config, impl)
    common.parity(ref, shard_model(model, _cp(mode)), inputs, what)


def check_left_padding_llama_both_modes_eager_and_sdpa():
    # 13 tokens: the split pads the sequence to 16 itself, so all-to-all must not count its padding as keys
    config = tiny_config(tf.LlamaConfig)
    for mode in ("ring", "all_to_all"):
        for impl in ("eager", "sdpa"):
            _parity(tf.LlamaForCausalLM, config, impl, mode, left_padded(13), f"llama/{impl} {mode} left padding")


def check_left_padding_gemma2_all_to_all_eager():
    config = tiny_config(tf.Gemma2Config)  # soft-capped attention: all-to-all only
    _parity(tf.Gemma2ForCausalLM, config, "eager", "all_to_all", left_padded(13), "gemma2/eager left padding")


def check_positions_the_model_derives():
    # RoBERTa counts positions from padding_idx + 1 over its non-padding ids, OPT over the attention mask
    config = tiny_config(tf.RobertaConfig, is_decoder=True, pad_token_id=1)
    inputs = common.batch(12)
    inputs.pop("attention_mask")  # no padding at all
    _parity(tf.RobertaForCausalLM, config, "sdpa", "ring", inputs, "roberta without padding")
    _parity(tf.OPTForCausalLM, tiny_config(tf.OPTConfig), "sdpa", "all_to_all", left_padded(12, pad=1), "opt left")


def check_dynamic_ntk_rope():
    # 16 tokens past max_position_embeddings=8: the frequencies follow the largest position of the call
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    config = tiny_config(tf.LlamaConfig, max_position_embeddings=8, rope_parameters=rope)
    _parity(tf.LlamaForCausalLM, config, "sdpa", "ring", common.batch(16), "llama dynamic rope")


def check_phi3_attention_config_copies():
    _parity(tf.Phi3ForCausalLM, tiny_config(tf.Phi3Config), "sdpa", "ring", common.batch(13), "phi3 ring")


def check_generate_without_cache_and_logits_to_keep():
    ref, model = common.pair("llama")
    model = shard_model(model, _cp()).eval()
    prompt = common.batch(7)["input_ids"]
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, "use_cache": False}
    assert torch.equal(model.generate(prompt, **kwargs), ref.eval().generate(prompt, **kwargs))
    with torch.no_grad():
        got, expected = model(input_ids=prompt, logits_to_keep=1).logits, ref(input_ids=prompt).logits[:, -1:]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def _dropout_masks(model, inputs):
    """The masks of every dropout (the layers' own and functional ones) in one training forward."""
    masks = []

    def record(_module, args, out):
        masks.append((out == 0) & (args[0] != 0))

    hooks = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, SeededDropout)]
    functional = F.dropout

    def dropout(x, p=0.5, training=True, inplace=False):
        out = functional(x, p, training, inplace)
        masks.append((out == 0) & (x != 0))
        return out

    F.dropout = dropout  # transformers' layers call torch.nn.functional.dropout
    try:
        model(**inputs).loss.backward()
    finally:
        F.dropout = functional
        for h in hooks:
            h.remove()
    return masks


def check_dropout_masks_differ_across_cp_ranks_and_replay():
    inputs = common.batch(16)
    for cls, config_cls, drops in (
        (tf.GPT2LMHeadModel, tf.GPT2Config, {"resid_pdrop": 0.2, "embd_pdrop": 0.2, "attn_pdrop": 0.2}),
        (tf.OPTForCausalLM, tf.OPTConfig, {"dropout": 0.2, "attention_dropout": 0.2}),
    ):
        runs = []
        for _ in range(2):  # the same seeds replay the same masks
            _, model = load_pair(cls, tiny_config(config_cls, **drops), "eager")
            model = shard_model(model, _cp("all_to_all")).train()
            torch.manual_seed(11)
            runs.append(_dropout_masks(model, inputs))
        assert len(runs[0]) > 0 and all(torch.equal(a, b) for a, b in zip(*runs)), f"{cls.__name__}: no replay"
        mine = torch.cat([m.flatten() for m in runs[0]]).float()
        theirs = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(theirs, mine)
        assert mine.mean() > 0.05, f"{cls.__name__}: dropout did not run"
        assert not torch.equal(theirs[0], theirs[1]), f"{cls.__name__}: cp ranks drew the same dropout masks"


def _position_signal(_module, args):
    """A position signal from the index along the sequence: a cp rank counts from 0 on its own tokens."""
    (x,) = args
    return (x + 0.5 * torch.arange(x.shape[1], dtype=x.dtype)[None, :, None],)


def _length_scaled(mlp):
    """A forward patched on the instance that scales by the sequence's length: a cp rank sees its own."""
    forward = type(mlp).forward
    mlp.forward = types.MethodType(lambda self, x: forward(self, x * x.shape[1] ** 0.5), mlp)


def check_proof_refuses_instances_the_split_changes():
    """Token by token these additions mix nothing (the probes admit them), yet a split computes something
    else: the proof runs the instance's tiny copy split and refuses before any cut, naming the module;
    unproven (as before the proof), the same model is silently wrong. A clean instance of the class is
    proven in the same process: its verdict does not cover the changed one."""
    inputs = common.batch(16)
    for mode, change in (
        ("all_to_all", lambda m: m.model.layers[0].mlp.register_forward_pre_hook(_position_signal)),
        ("ring", lambda m: _length_scaled(m.model.layers[1].mlp)),
    ):
        _, clean = common.pair("llama")
        assert sharding_of(shard_model(clean, _cp(mode))).context_parallel.proven
        ref, model = common.pair("llama")
        change(ref), change(model)
        layer = "0" if mode == "all_to_all" else "1"
        with pytest.raises(NotProvenError, match=rf"not exact .*first diverging module: model.layers.{layer}.mlp"):
            shard_model(model, _cp(mode))
        model = shard_model(model, _cp(mode, prove=False))
        with torch.no_grad():
            got, expected = common.full_logits(model, model(**inputs).logits, 16), ref(**inputs).logits
        assert (got - expected).abs().max() > 1e-2, f"{mode}: the unproven split is not wrong: nothing to refuse"


CHECKS = [
    check_left_padding_llama_both_modes_eager_and_sdpa,
    check_left_padding_gemma2_all_to_all_eager,
    check_positions_the_model_derives,
    check_dynamic_ntk_rope,
    check_phi3_attention_config_copies,
    check_generate_without_cache_and_logits_to_keep,
    check_dropout_masks_differ_across_cp_ranks_and_replay,
    check_proof_refuses_instances_the_split_changes,
]
