"""Context parallelism at cp=2 against the unsharded model: Llama, Qwen3, Mistral (sliding window
of 4 over 13 tokens) and GPT-2 (absolute positions), in both modes, eager and sdpa, with a
right-padded batch; 13 tokens (2 * cp does not divide: padded internally, exactly) and 16.
Logits, loss, every gradient, weights after a step; greedy generate; refusals; and trust.py's
checks (left padding, derived positions, dynamic rotary, Phi-3, dropout per cp rank) and tiles.py's (ring
attention in small tiles). One spawn.
"""

import gc

import pytest
import torch
import torch.distributed as dist
import transformers as tf
from transformers.models.llama.modeling_llama import LlamaMLP

from shardformer import ShardConfig, shard_model, sharding_of
from shardformer.context_parallel import check_context_parallel
from shardformer.context_parallel.attention import SplitMask
from shardformer.core.comm import CollectiveCounter
from shardformer.core.tiny import tiny_config
from shardformer.policies.anatomy import stack_anatomy
from shardformer.policies.routes import NONE
from shardformer.tools.pair_check import load_pair
from tests.context_parallel import common, tiles, trust
from tests.helpers import assert_close, assert_grads_match, check_table


def _cp(mode, **kw):
    return ShardConfig(context_parallel_size=dist.get_world_size(), context_parallel_mode=mode, **kw)


def _check(name, mode, impl, seq, **overrides):
    ref, model = common.pair(name, impl, **overrides)
    model = shard_model(model, _cp(mode))
    assert sharding_of(model).context_parallel.proven, f"{name} {mode}: the split was not proven"
    with CollectiveCounter() as counter:
        common.parity(ref, model, common.batch(seq), f"{name}/{impl} cp=2 {mode} seq={seq}")
    kind = "all_to_all" if mode == "all_to_all" else "send"
    assert counter.counts[kind] > 0, f"{name}: {mode} attention did not run: {counter.counts}"


def check_llama_ring_sdpa_13():
    _check("llama", "ring", "sdpa", 13)


def check_llama_all_to_all_eager_16():
    _check("llama", "all_to_all", "eager", 16)


def check_qwen3_ring_eager_16():
    _check("qwen3", "ring", "eager", 16)


def check_qwen3_all_to_all_sdpa_13():
    _check("qwen3", "all_to_all", "sdpa", 13)


def check_mistral_sliding_window_both_modes():
    ref, _ = common.pair("mistral")
    no_window, _ = common.pair("mistral", sliding_window=None)
    ids = common.batch(13)["input_ids"]
    assert not torch.allclose(ref(input_ids=ids).logits, no_window(input_ids=ids).logits), "the window is not active"
    _check("mistral", "ring", "sdpa", 13)
    _check("mistral", "all_to_all", "eager", 13)


def check_gpt2_ring_eager_13():
    _check("gpt2", "ring", "eager", 13)


def check_gpt2_all_to_all_sdpa_16():
    _check("gpt2", "all_to_all", "sdpa", 16)


def check_generate_and_gathered_logits():
    """generate() runs unsplit (a cache is passed); gather_output gives whole, in-order logits."""
    ref, model = common.pair("llama")
    model = shard_model(model, _cp("ring", gather_output=True)).eval()
    prompt = common.batch(7)["input_ids"]
    kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(model.generate(prompt, **kwargs), ref.eval().generate(prompt, **kwargs))
    with torch.no_grad():
        got, expected = model(input_ids=prompt).logits, ref(input_ids=prompt).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def check_ring_keeps_no_block_masks_for_backward():
    """The ring keeps no mask (a block's is batch x n^2 bools): the forward's layers and the backward
    share only which tiles attend fully or not at all; backward evaluates the partial tiles again."""
    ref, model = common.pair("llama")
    model = shard_model(model, _cp("ring"))
    inputs = common.batch(16)
    out = model(**inputs)
    masks = [o for o in gc.get_objects() if isinstance(o, SplitMask)]  # the graph holds this forward's
    assert masks and all(not m._cache for m in masks), [len(m._cache) for m in masks]
    assert all(isinstance(kind, bool) for m in masks for kind in m._tiles.values())
    out.loss.backward()
    expected = ref(**inputs).loss
    expected.backward()
    assert_grads_match(model, ref, None)


def check_gpt_oss_at_tp1_with_attention_sinks():
    """tp=1 derives no cut (it failed dividing a count by tp); all-to-all hands each rank its heads' sinks
    (GPT-OSS's eager attention reads them off the module); the ring refuses them by name."""
    ref, model = load_pair(tf.GptOssForCausalLM, tiny_config(tf.GptOssConfig), "eager")
    common.parity(ref, shard_model(model, _cp("all_to_all")), common.batch(16), "gpt-oss/eager cp=2 all_to_all")
    _, model = load_pair(tf.GptOssForCausalLM, tiny_config(tf.GptOssConfig), "eager")
    with pytest.raises(ValueError, match="context_parallel_mode='ring' cannot compute GptOssAttention's attention"):
        shard_model(model, _cp("ring"))  # when sharded, not at the first step


def check_derived_route_decoder_and_encoder():
    """No transformers tp plan: GPT-BigCode (one key/value head) and a RoBERTa encoder without its
    pooler (bidirectional, positions counted from its ids), derived-route models, split over the sequence
    (at tp=1 nothing is cut: the route is "none: tp=1")."""
    ref, model = load_pair(tf.GPTBigCodeForCausalLM, tiny_config(tf.GPTBigCodeConfig), "sdpa")
    model = shard_model(model, _cp("ring"))
    assert sharding_of(model).route == NONE, sharding_of(model).route
    common.parity(ref, model, common.batch(13), "gpt-bigcode/sdpa cp=2 ring")
    ref, model = load_pair(tf.RobertaModel, tiny_config(tf.RobertaConfig, pad_token_id=1), "eager")
    ref.pooler = model.pooler = None  # its pooler reads the first token: refused (test_anatomy_decides...)
    model = shard_model(model, _cp("all_to_all"))
    assert sharding_of(model).route == NONE, sharding_of(model).route
    inputs = common.batch(13)
    inputs.pop("labels")
    common.parity(ref, model, inputs, "roberta encoder/eager cp=2 all_to_all")


def check_refusals_before_any_collective():
    _, model = common.pair("gpt2")
    classifier = tf.GPT2ForSequenceClassification(model.config)
    with pytest.raises(ValueError, match="only causal language models and base models"):
        shard_model(classifier, _cp("ring"))
    config = tiny_config(tf.LlamaConfig, hidden_size=24, num_attention_heads=3, num_key_value_heads=3, head_dim=8)
    _, odd_heads = load_pair(tf.LlamaForCausalLM, config, "sdpa")
    with pytest.raises(ValueError, match="use context_parallel_mode='ring'"):
        shard_model(odd_heads, _cp("all_to_all"))
    ref, model = common.pair("llama")
    model = shard_model(model, _cp("ring"))
    # inputs other than tokens (an image's features go where its tokens are): refused on both ranks alike
    # (GotOcr2 hung: one rank's image-token count check failed while the other waited in the ring)
    with pytest.raises(ValueError, match="cannot split a forward with pixel_values: it splits the token inputs"):
        model(**common.batch(16), pixel_values=torch.zeros(2, 3, 4, 4))
    assert_close(model(**common.batch(16)).loss, ref(**common.batch(16)).loss, what="llama after the refusals")


test_cp2 = check_table(
    [
        check_llama_ring_sdpa_13,
        check_llama_all_to_all_eager_16,
        check_qwen3_ring_eager_16,
        check_qwen3_all_to_all_sdpa_13,
        check_mistral_sliding_window_both_modes,
        check_gpt2_ring_eager_13,
        check_gpt2_all_to_all_sdpa_16,
        check_generate_and_gathered_logits,
        check_ring_keeps_no_block_masks_for_backward,
        check_gpt_oss_at_tp1_with_attention_sinks,
        check_derived_route_decoder_and_encoder,
        check_refusals_before_any_collective,
        *trust.CHECKS,
        *tiles.CHECKS,
    ],
    2,
)


def test_config_is_checked():
    with pytest.raises(ValueError, match="context_parallel_mode='zigzag' must be one of 'ring', 'all_to_all'"):
        ShardConfig(context_parallel_size=2, context_parallel_mode="zigzag")
    with pytest.raises(ValueError, match="context_parallel_size=0 must be a positive integer"):
        ShardConfig(context_parallel_size=0)
    ShardConfig(context_parallel_size=2, pipeline_parallel_size=2)  # ParallelEngine splits each stage's micro-batch
    from shardformer import EngineConfig

    EngineConfig(cp=2, pp=2)  # test_engine.py trains it on both pipeline backends
    with pytest.raises(ValueError, match="compile=True is not supported"):
        EngineConfig(cp=2, compile=True)
    with pytest.raises(ValueError, match="EngineConfig.cp_mode='x'"):
        EngineConfig(cp=2, cp_mode="x")


class _NoPositions(tf.LlamaForCausalLM):
    def forward(self, input_ids=None, attention_mask=None, labels=None):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def test_positions_refused_where_unknown():
    from shardformer.context_parallel.positions import whole_positions

    model = _NoPositions(tiny_config(tf.LlamaConfig))
    with pytest.raises(ValueError, match="its forward takes no position_ids"):
        check_context_parallel(model, ShardConfig(context_parallel_size=2))

    ids = torch.arange(6).view(1, 6)
    with pytest.raises(ValueError, match="by no rule known here.*pass position_ids"):
        whole_positions(None, "Custom", 0, ids, None, 1, 6, "cpu")
    with pytest.raises(ValueError, match="from input_ids and its pad_token_id, and this forward has no input_ids"):
        whole_positions("ids", "RobertaForCausalLM", 1, None, None, 1, 6, "cpu")
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    assert whole_positions("mask", "OPT", None, ids, mask, 1, 6, "cpu").tolist() == [[-1, -1, 0, 1, 2, 3]]
    assert whole_positions("ids", "Roberta", 1, torch.tensor([[1, 1, 5, 6]]), None, 1, 4, "cpu").tolist() == [
        [1, 1, 2, 3]
    ]


class _TokenShiftMLP(LlamaMLP):
    def forward(self, x):
        return super().forward(torch.roll(x, 1, dims=1))  # reads the previous token: mixing outside attention


class _TokenShiftLlama(tf.LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            layer.mlp.__class__ = _TokenShiftMLP


def test_anatomy_decides_what_is_split():
    """Refused before anything is cut, naming why: ALiBi models (BLOOM, MPT: their attention, biases
    from positions included, is their own code), a pooler after the layer stack (the anatomy's, proven
    per-token on a tiny copy), a forward that pools itself (CLIP's text model), two stacks, and a layer
    that mixes tokens outside attention (found on a tiny copy with attention made per-token)."""
    config = ShardConfig(context_parallel_size=2)

    def check(model):  # as shard_model checks it: with what the model's anatomy says
        return check_context_parallel(model, config, stack_anatomy(model))

    for cls, config_cls in ((tf.BloomForCausalLM, tf.BloomConfig), (tf.MptForCausalLM, tf.MptConfig)):
        with pytest.raises(ValueError, match="does not go through transformers' attention interface"):
            check(cls(tiny_config(config_cls)))
    bert = tiny_config(tf.BertConfig)
    with pytest.raises(ValueError, match=r"pooler \(BertPooler\) turns the hidden states .* add_pooling_layer=False"):
        check(tf.BertModel(bert))
    assert check(tf.BertModel(bert, add_pooling_layer=False)).positions == "arange"
    with pytest.raises(ValueError, match=r"its forward returns pooler_output \(2, 32\), one value per row"):
        check(tf.CLIPTextModel(tiny_config(tf.CLIPTextConfig)))
    with pytest.raises(ValueError, match="its anatomy finds 2 .text_model.encoder.layers, vision_model"):
        check(tf.CLIPModel(tiny_config(tf.CLIPConfig)))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp \(_TokenShiftMLP\) mixes tokens outside attention"):
        check(_TokenShiftLlama(tiny_config(tf.LlamaConfig)))
    assert check(tf.LlamaForCausalLM(tiny_config(tf.LlamaConfig))).positions == "arange"


def test_ring_refuses_softcap_and_sinks_when_sharded():
    """Logit soft-capping (Gemma-2) and attention sinks (GPT-OSS) change the softmax the ring merges:
    refused from the attention modules when the model is sharded; all-to-all computes them."""
    for config, attention, passed in (
        (tiny_config(tf.Gemma2Config), "Gemma2Attention", "softcap"),
        (tiny_config(tf.GptOssConfig), "GptOssAttention", "s_aux"),
    ):
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        with pytest.raises(ValueError, match=f"cannot compute {attention}'s attention with {passed} exactly"):
            check_context_parallel(model, ShardConfig(context_parallel_size=2))
        check_context_parallel(model, ShardConfig(context_parallel_size=2, context_parallel_mode="all_to_all"))
    no_cap = tf.AutoModelForCausalLM.from_config(tiny_config(tf.Gemma2Config, attn_logit_softcapping=None))
    check_context_parallel(no_cap, ShardConfig(context_parallel_size=2))


def test_a_mask_read_as_tensor_is_refused():
    """A model whose own code reads its attention mask as a tensor (Doge: ``attention_mask.dtype``) is
    refused when sharded, found on the tiny copy that proves what mixes tokens; in a split forward the
    mask (a SplitMask) gives the same error on any such read, a ValueError (and an AttributeError, so
    hasattr still answers False)."""
    doge = tf.DogeForCausalLM(tiny_config(tf.DogeConfig))
    with pytest.raises(ValueError, match=r"DogeForCausalLM cannot .* reads its attention mask as a tensor \(\.dtype\)"):
        check_context_parallel(doge, ShardConfig(context_parallel_size=2), stack_anatomy(doge))
    mask = SplitMask(None, None, "ring", None, torch.ones(1, 4, dtype=torch.bool), {}, "sdpa", None)
    reads = (lambda: mask.dtype, lambda: mask[:, :2], lambda: torch.where(mask, 0.0, 1.0), lambda: torch.ones(1) + mask)
    for read in reads:
        with pytest.raises(ValueError, match="reads its attention mask as a tensor"):
            read()
    assert not hasattr(mask, "shape") and mask.layout is None
