"""The derived route: models with neither a built-in policy nor a tp plan, cut by what their
projections do in a traced tiny copy and proven on the ranks before use.

One representative per layout kind: separate q/k/v (OPT, a decoder), cross-attention (BART, an
encoder-decoder with tied scaled embeddings), a post-norm encoder with a masked-LM head (RoBERTa),
two towers (CLIP), audio into an encoder-decoder (Whisper), and fused ``[Q | K | V]`` and
``[gate | up]`` projections whose names lie about their roles, T5's relative attention bias (a
per-head parameter) and BLOOM's ALiBi (a per-head input). Each is compared with the unsharded
model by ``verify`` (outputs, loss, gradients, weights after a step, greedy generate)."""

from __future__ import annotations

import torch

from shardformer.policies.auto import get_autopolicy
from shardformer.policies.derived import DerivedPolicy, derive
from shardformer.policies.derived.blocks import blocks_to_cut, repeated_blocks
from shardformer.policies.derived.trace import pair, trace
from shardformer.tools.testing import run_on_ranks
from tests.policies.derived_models import factory, liar, transformers_model

T5_128 = dict(
    d_model=128,
    d_ff=256,
    num_layers=2,
    num_heads=8,
    d_kv=16,
    vocab_size=300,
    feed_forward_proj="gated-gelu",
    decoder_start_token_id=0,
)
ALBERT = dict(
    embedding_size=16, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64, vocab_size=99
)
OPT_DEFAULT_FFN = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=99, dropout=0.0)
EXACT = [
    ("liar", {}),
    ("liar", {"head_norm": True}),
    ("liar", {"head_scale": True}),  # a scale of the queries shared by the heads: its gradient summed over tp
    ("liar", {"head_reads_weight": True}),  # logits = x @ lm_head.weight.t(): the vocabulary stays whole
    ("liar", {"channel_norm": True}),  # a BatchNorm on the MLP's inner channels (LeViT's): cut with them
    ("OPTForCausalLM", {}),
    ("BartForConditionalGeneration", {}),
    ("T5ForConditionalGeneration", {}),  # relative attention bias [buckets, heads]: cut with the heads
    ("FalconForCausalLM", {}),  # multi-query fused [Q | K | V] of H + 2 heads in FalconLinear: K/V replicated
    ("LlamaForCausalLM", {"num_key_value_heads": 1}),  # the plan route, one key/value head replicated
    # towers proven on the inputs they get inside the whole model: Qwen2-VL's patches with their grid
    # (and its multimodal rotary)
    ("Qwen2VLForConditionalGeneration", {}),
    # vision attention that reads its heads' width from the input's width: given one that reads it from
    # the module; a Q-Former with cross-attention into the image; OPT as its language model
    ("Blip2ForConditionalGeneration", {"image_token_index": 50265}),
    # at the user's sizes, not the tiny copy's: a count equal to a cut width by chance (max distance 128,
    # d_model 128) stays whole as the proven rule says; gated feed-forward
    ("sized:T5ForConditionalGeneration", T5_128),
    # OPT at a user's width with ffn_dim left at its default (3072 beside hidden 64; the tiny copy keeps
    # the ratio, 1536 beside 32): reported 1e-3 off, measured at rounding (gradients within 1e-6 of their
    # scale, as the unsharded model in fp32 is of its fp64 self)
    ("sized:OPTForCausalLM", OPT_DEFAULT_FFN),
    # a table computed once from the boxes (Bros's bbox_projection), read by each rank's heads in every
    # block: its gradient summed over tp
    ("runnable:BrosForTokenClassification", {}),
    # ALBERT: one layer applied three times (its weights cut once, their gradients added over the
    # applications) after a factorised embedding (16 -> 32 through embedding_hidden_mapping_in)
    ("sized:AlbertForMaskedLM", ALBERT),
    # CodeGen regroups its fused qkv into 4 fixed blocks of [q | v | k]: 12 blocks cut, the output
    # projection's input in 4 (derived on a wider copy: 4 blocks of one head cannot split)
    ("sized:CodeGenForCausalLM", dict(n_embd=128, n_head=16, n_layer=2, vocab_size=300, rotary_dim=4, n_positions=64)),
    # transformers 5.24 ships a tp plan for CodeGen that the plan route does not cut exactly (its
    # [q | v | k] blocks): the proof rejects it and the derived route, proven, takes over
    ("CodeGenForCausalLM", {}),
    # BigBird switches to full attention at short sequences: a new attention module built from its
    # parent's config while running, which counts the rank's heads (the parent holds a per-rank config)
    ("BigBirdForMaskedLM", {}),
    # TIPSv2's tiny copy differs by float32 rounding alone (a gradient 2e-4 off at its scale): the proof's
    # float64 rerun, at 10^4-fold tighter tolerances, finds it exact (refused before it)
    ("runnable:Tipsv2Model", {}),
    # GPT-OSS's attention keeps no head count, yet holds one sink per head: cut with the heads counted
    # by the config it keeps (proven at the model's own 4 heads, not on a wider copy)
    ("GptOssForCausalLM", {}),
    # WavLM hands its projections' weights to F.multi_head_attention_forward: the read is followed
    # (this rank's heads of its gated relative-position mask; the mask's tables' gradients summed)
    ("runnable:WavLMForCTC", {}),
    # Nystromformer's depthwise convolution over the heads' values (groups = heads): cut with the heads
    ("NystromformerModel", {}),
    # LFM's short convolution over in_proj's [B | C | x] channels (depthwise): cut with the blocks
    ("Lfm3ForCausalLM", {}),
    # a convolutional network cut over channels: the stem and the residual stream it joins (identity
    # shortcut) by output channels, batch norms with them, the 1x1 and shortcut convolutions reading them by
    # input channels; a bottleneck's 3x3 -> 1x1 pair; 32-pixel images
    ("sized:ResNetModel", dict(hidden_sizes=[16, 32], depths=[1, 1], embedding_size=16)),
    # BLIP's vision attention splits its fused qkv by its head count beside the input's width (the count
    # made local as it runs); its tiny copy's 1e-10 initialisation redrawn, else any cut matched to 1e-25
    ("runnable:BlipModel", {}),
    # ConvNeXt-V2's GRN between pwconv1 and pwconv2 (BitNet's RMS norms before o_proj and down_proj alike):
    # its weight and bias cut with the features, its mean over them the mean of the ranks' means
    ("sized:ConvNextV2Model", dict(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, image_size=32)),
]


def test_roles_come_from_the_dataflow_not_the_names():
    model = liar()
    flows = trace(model, {"input_ids": torch.randint(0, 99, (2, 6))})
    assert flows.blocks == ["layers.0", "layers.1", "layers.2"]
    groups, whole = pair(flows.reads["layers.0"])
    assert {(g.cols, g.row) for g in groups} == {(("mixer.down_proj",), "mixer.q_proj"), (("o_proj",), "up_proj")}
    assert whole == []


def test_layers_behind_bottlenecks_left_whole_are_paired():
    """MobileBERT's attention and feed-forward layers read its bottlenecks' narrow output (projections of
    the stream, left whole), not the stream: paired behind them (exact in the conformance sweep)."""
    from shardformer.core.inputs import make_inputs

    model = factory("runnable:MobileBertForSequenceClassification")().eval()
    inputs = make_inputs(model, seed=0)
    inputs.pop("labels", None)
    reads = trace(model, inputs).reads["mobilebert.encoder.layer.0"]
    assert pair(reads) == ([], list(reads))  # nothing reads the stream and feeds a row
    groups, whole = pair(reads, after_whole=True)
    assert ("attention.self.key", "attention.self.query", "attention.self.value") in [g.cols for g in groups]
    assert {g.row for g in groups} >= {"attention.output.dense", "ffn.0.output.dense", "output.dense"}
    assert set(whole) == {"bottleneck.input.dense", "bottleneck.attention.dense", "output.bottleneck.dense"}


def test_fused_blocks_and_per_rank_attributes_are_found_by_simulation():
    rule = derive(liar(), 2).rules[type(liar().layers[0])]
    assert rule.cols == {"mixer.down_proj": 3, "o_proj": 2}  # [Q | K | V] and [gate | up]
    assert rule.rows == {"mixer.q_proj", "up_proj"}
    assert rule.divide == {"mixer.num_heads"}


def test_tables_read_by_the_heads_alone_have_their_gradients_summed():
    """A parameter whose output meets only this rank's heads before a row projection (a position
    table read inside the attention, or one the model computes once and hands to every block) gets a
    part of its gradient on each rank; one that also reaches a column or the outputs is left alone."""
    derivation = derive(factory("runnable:BrosForTokenClassification")(), 2)
    assert derivation.grad_sum == {"bros.bbox_embeddings.bbox_projection"}
    assert derive(liar(head_norm=True), 2).rules[type(liar().layers[0])].grad_sum == {"mixer.q_norm"}
    assert derive(liar(head_scale="both"), 2).rules[type(liar().layers[0])].grad_sum == set()


def test_a_group_reading_zeros_for_want_of_a_kernel_names_the_kernel():
    """MRA's attention returns zeros where transformers' CUDA kernel is not loaded (on CPU): its output
    projection reads zeros, and the refusal names the missing kernel, not a cut that failed."""
    from transformers import MraConfig
    from transformers.models.mra.modeling_mra import MraAttention

    from shardformer.policies.derived.missing_kernels import zeros_without_kernel

    attention = MraAttention(MraConfig(hidden_size=32, num_attention_heads=4))
    why = zeros_without_kernel(attention, "output.dense", torch.zeros(2, 8, 32))
    assert "mra_cuda_kernel is None" in why and why.fix.startswith("load the kernel"), why
    assert zeros_without_kernel(attention, "output.dense", torch.ones(2, 8, 32)) is None  # it computed something
    assert zeros_without_kernel(torch.nn.Linear(4, 4), "weight", torch.zeros(2, 4)) is None  # no kernel missing


def test_embeddings_whose_forward_indexes_their_weight_stay_whole():
    """WhisperForCausalLM's positional embedding is an ``nn.Embedding`` called with the caller's token ids
    whose own forward slices its weight (``self.weight[:n]``): no vocab-parallel lookup can stand in for it
    (cut, the decoder's first projection read wrong positions); the token embedding is a plain lookup."""
    derivation = derive(factory("WhisperForCausalLM")(), 2)
    assert "model.decoder.embed_positions" in derivation.read_by_weight
    assert "model.decoder.embed_tokens" in derivation.embeddings
    assert "model.decoder.embed_tokens" not in derivation.read_by_weight


def test_route_order():
    assert type(get_autopolicy(transformers_model("OPTForCausalLM"))) is DerivedPolicy
    assert type(get_autopolicy(transformers_model("LlamaForCausalLM"))).__name__ == "TpPlanPolicy"
    assert type(get_autopolicy(transformers_model("GPT2LMHeadModel"))).__name__ == "GPT2LMHeadPolicy"
    # a plan that names only the LM head would leave every layer whole: the layers are derived instead
    assert type(get_autopolicy(transformers_model("Emu3ForCausalLM"))) is DerivedPolicy


def test_repeated_blocks_of_two_towers_and_an_encoder_decoder():
    clip = transformers_model("CLIPModel")
    blocks = repeated_blocks(clip)
    assert "text_model.encoder.layers.0" in blocks and "vision_model.encoder.layers.1" in blocks
    bart = repeated_blocks(transformers_model("BartForConditionalGeneration"))
    assert "model.encoder.layers.0" in bart and "model.decoder.layers.1" in bart
    # ALBERT's one layer group, applied num_hidden_layers times: no stack for pipeline stages, one block for tp
    albert = factory("sized:AlbertForMaskedLM", **ALBERT)()
    assert repeated_blocks(albert) == []
    assert blocks_to_cut(albert) == ["albert.encoder.albert_layer_groups.0"]


def _ranks(cases, refused):
    import torch.distributed as dist

    from shardformer import ShardConfig, shard_model
    from shardformer.policies.derived import NotDerivableError, NotProvenError
    from shardformer.tools.verify import verify_on_this_rank

    out = {}
    for name, options in cases:
        report = verify_on_this_rank(factory(name, **options))
        out[f"{name}{options or ''}"] = (report.ok, report.format())
    # sharded for real: parameters per rank near 1/tp of the blocks
    model = factory("OPTForCausalLM")()
    full = sum(p.numel() for p in model.parameters())
    shard_model(model, ShardConfig(tensor_parallel_size=dist.get_world_size()))
    out["ratio"] = sum(p.numel() for p in model.parameters()) / full
    # LLaVA: the plan cuts the language model, the derived route the CLIP vision tower (proven first)
    llava = factory("LlavaForConditionalGeneration")()

    def projection_weights():  # every projection of the tower's blocks: q, k, v, out, fc1, fc2
        layers = llava.model.vision_tower.encoder.layers
        return sum(
            p.numel() for n, p in layers.named_parameters() if n.endswith(("proj.weight", "fc1.weight", "fc2.weight"))
        )

    full = projection_weights()
    shard_model(llava, ShardConfig(tensor_parallel_size=dist.get_world_size()))
    out["tower ratio"] = projection_weights() / full
    qwen = factory("Qwen2VLForConditionalGeneration")()  # a tower taking patches and their grid
    blocks = qwen.model.visual.blocks
    full = sum(p.numel() for n, p in blocks.named_parameters() if n.endswith(".weight") and p.dim() == 2)
    shard_model(qwen, ShardConfig(tensor_parallel_size=dist.get_world_size()))
    out["grid tower ratio"] = (
        sum(p.numel() for n, p in blocks.named_parameters() if n.endswith(".weight") and p.dim() == 2) / full
    )
    # BART's loss on vocab-parallel logits, with a final_logits_bias that is not zero: cut with the
    # vocabulary, added to this rank's logits, whole again for generate and in the export
    import copy

    from shardformer.checkpoint import gather_full_state
    from shardformer.core.inputs import make_inputs

    bart = factory("BartForConditionalGeneration")()
    bart.final_logits_bias.normal_()
    ref_bart = copy.deepcopy(bart)
    shard_model(bart, ShardConfig(tensor_parallel_size=dist.get_world_size()))
    inputs = make_inputs(ref_bart, seed=4)
    got, want = bart(**inputs), ref_bart(**inputs)
    full_bias = gather_full_state(bart)
    out["bart"] = (
        tuple(got.logits.shape),
        abs(got.loss.item() - want.loss.item()),
        None if full_bias is None else (full_bias["final_logits_bias"] - ref_bart.final_logits_bias).abs().max().item(),
        torch.equal(
            bart.generate(inputs["input_ids"], max_new_tokens=3),
            ref_bart.generate(inputs["input_ids"], max_new_tokens=3),
        ),
    )
    whisper = factory("WhisperForConditionalGeneration")()  # decoder inputs by its shift_tokens_right
    ref_whisper = copy.deepcopy(whisper)
    shard_model(whisper, ShardConfig(tensor_parallel_size=dist.get_world_size()))
    inputs = make_inputs(ref_whisper, seed=4)
    got, want = whisper(**inputs), ref_whisper(**inputs)
    out["whisper"] = (got.logits.shape[-1], abs(got.loss.item() - want.loss.item()))
    albert = factory("sized:AlbertForMaskedLM", **ALBERT)()
    shard_model(albert, ShardConfig(tensor_parallel_size=dist.get_world_size()))
    shared = albert.albert.encoder.albert_layer_groups[0].albert_layers[0]
    out["albert"] = (tuple(shared.attention.query.weight.shape), tuple(shared.ffn.weight.shape))
    # T5's relative attention bias is cut with the heads: each rank holds its heads' columns
    t5 = factory("T5ForConditionalGeneration")()
    bias = t5.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    full_shape = tuple(bias.shape)
    shard_model(t5, ShardConfig(tensor_parallel_size=dist.get_world_size()))
    bias = t5.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    out["t5 bias"] = (full_shape, tuple(bias.shape))
    out["whole vocabulary"] = _whole_vocabulary()
    out["t5gemma2"] = _t5gemma2_eoi()
    out["bigbird block sparse"] = _bigbird_block_sparse()
    for name, options in refused:
        key = f"refused {name}{options}"
        try:
            shard_model(factory(name, **options)(), ShardConfig(tensor_parallel_size=2))
            out[key] = "sharded"
        except NotProvenError as e:
            out[key] = f"not proven: {e}"
        except NotDerivableError as e:
            out[key] = f"not derivable: {e}"
    return out


def _whole_vocabulary() -> tuple[str, str, str]:
    """An LM head whose weight the model's code reads itself (as MobileBERT's and Perceiver's do): the
    route, the class of the head (left whole) and of the untied input embedding (still vocab-parallel)."""
    from shardformer import ShardConfig, shard_model

    model = shard_model(liar(head_reads_weight=True), ShardConfig(tensor_parallel_size=2))
    return model.shardformer.route, type(model.lm_head).__name__, type(model.embed).__name__


def _bigbird_block_sparse() -> tuple:
    """BigBird's block-sparse attention at a sequence long enough to run it (the proof's is not): its
    difference in eval, its refusal in training (each head's random blocks drawn head after head from
    numpy's generator), and its difference at a short sequence after (full attention, rebuilt)."""
    import copy

    import transformers as tf

    from shardformer import ShardConfig, shard_model
    from shardformer.core.refusal import Refusal

    sizes = dict(hidden_size=32, num_attention_heads=4, intermediate_size=36, num_hidden_layers=2, vocab_size=99)
    config = tf.BigBirdConfig(**sizes, block_size=2, num_random_blocks=1, max_position_embeddings=64)
    model = tf.BigBirdModel(config).eval()
    ref = copy.deepcopy(model)
    shard_model(model, ShardConfig(tensor_parallel_size=2))
    ids = torch.randint(0, 99, (2, 32), generator=torch.Generator().manual_seed(0))
    long_diff = (model(input_ids=ids).last_hidden_state - ref(input_ids=ids).last_hidden_state).abs().max().item()
    try:
        model.train()(input_ids=ids)
        refusal = ""
    except Refusal as e:
        refusal = str(e)
    model.eval()
    short = ids[:, :8]
    short_diff = (model(input_ids=short).last_hidden_state - ref(input_ids=short).last_hidden_state).abs().max().item()
    return long_diff, refusal, short_diff


def _t5gemma2_eoi() -> tuple:
    """T5Gemma2's scaled embedding writes a learned ``eoi_embedding`` over one token's rows: sharded by
    vocabulary it keeps its own forward and that parameter (the token placed in the inputs, the vector not zero)."""
    import copy

    from shardformer import ShardConfig, shard_model
    from shardformer.core.inputs import make_inputs
    from shardformer.tensor_parallel.layers import VocabParallelEmbedding1D

    model = factory("T5Gemma2ForConditionalGeneration")()
    for module in model.modules():
        if hasattr(module, "eoi_embedding"):
            module.eoi_token_index = 7
            torch.nn.init.normal_(module.eoi_embedding)
    ref = copy.deepcopy(model)
    shard_model(model, ShardConfig(tensor_parallel_size=2))
    inputs = make_inputs(ref, seed=4)
    inputs["input_ids"][:, -1] = 7  # text after the image tokens
    got, want = model(**inputs), ref(**inputs)
    got.loss.backward(), want.loss.backward()
    embed, ref_embed = model.get_input_embeddings(), ref.get_input_embeddings()
    grad = (embed.eoi_embedding.grad - ref_embed.eoi_embedding.grad).abs().max().item()
    return isinstance(embed, VocabParallelEmbedding1D), abs(got.loss.item() - want.loss.item()), grad


def test_derived_models_are_exact_or_refused():
    refused = [("liar", {"head_scale": "both"}), ("liar", {"mix_heads": True})]
    results = run_on_ranks(_ranks, 2, EXACT, refused)
    out = results[0]
    for name, options in EXACT:
        ok, text = out[f"{name}{options or ''}"]
        assert ok, text
    assert "DerivedPolicy (derived route, proven on a tiny copy)" in out["CodeGenForCausalLM"][1]  # not the plan
    assert 0.5 < out["ratio"] < 0.6, out["ratio"]  # blocks and vocabulary halved; norms and positions whole
    assert out["tower ratio"] == 0.5, out["tower ratio"]
    assert out["grid tower ratio"] == 0.5, out["grid tower ratio"]
    shape, loss_diff, bias_diff, same_tokens = out["bart"]
    assert shape[-1] == 99 // 2 + 1 and loss_diff < 1e-5 and same_tokens, out["bart"]  # logits stay vocab-parallel
    assert bias_diff == 0.0, out["bart"]
    assert out["whisper"][0] == 99 // 2 + 1 and out["whisper"][1] < 1e-5, out["whisper"]
    assert out["albert"] == ((16, 32), (32, 32)), out["albert"]  # the one shared layer, cut once
    assert out["whole vocabulary"] == ("derived", "Linear", "VocabParallelEmbedding1D"), out["whole vocabulary"]
    cut, loss_diff, eoi_grad_diff = out["t5gemma2"]
    assert cut and loss_diff < 1e-5 and eoi_grad_diff < 1e-5, out["t5gemma2"]
    long_diff, refusal, short_diff = out["bigbird block sparse"]
    assert long_diff < 1e-5 and short_diff < 1e-5, out["bigbird block sparse"]
    assert "BigBirdBlockSparseAttention draws each head's random pattern" in refusal, refusal
    full, local = out["t5 bias"]
    assert local == (full[0], full[1] // 2), out["t5 bias"]
    # a scale shared by the heads that also scales the attention's input: the forward is exact, its
    # gradient on each rank part whole, part its heads' (no sum over ranks is exact)
    liar_scale = out["refused liar{'head_scale': 'both'}"]
    assert liar_scale.startswith("not proven") and "gradient of layers.0.mixer.head_scale" in liar_scale
    # queries that mix every head: no cut computes the attention exactly; the refusal names the group
    mixed = out["refused liar{'mix_heads': True}"]
    assert mixed.startswith("not derivable") and "mixer.down_proj -> mixer.q_proj" in mixed, mixed
    assert [results[1][f"{n}{o or ''}"][0] for n, o in EXACT] == [True] * len(EXACT)  # rank 1 agrees


def test_a_plan_that_names_no_module_is_refused_not_skipped():
    import pytest
    import torch.nn as nn

    from shardformer import ShardConfig
    from shardformer.policies.tp_plan import TpPlanPolicy, UnsupportedStyleError

    class Wrapper(nn.Module):  # what an adapter library does to the modules a plan names
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.base_layer = inner

        def forward(self, *args, **kwargs):
            return self.base_layer(*args, **kwargs)

    model = transformers_model("LlamaForCausalLM")
    for layer in model.model.layers:
        layer.self_attn, layer.mlp = Wrapper(layer.self_attn), Wrapper(layer.mlp)
    policy = TpPlanPolicy()
    policy.set_model(model)
    with pytest.raises(UnsupportedStyleError, match="names a module of LlamaForCausalLM"):
        policy.argument_policy(model.config, ShardConfig(tensor_parallel_size=2))


def _replicated_kv(tmp: str):
    """Multi-query attention (one key/value head) at tp=2: each rank holds every query head's half
    and the one key/value head whole; their gradients are summed, counted once in the norm, and
    the export and the sharded load put the one copy back."""
    import copy

    import torch.distributed as dist
    import transformers as tf

    from shardformer import ShardConfig, shard_model, sharding_of
    from shardformer.checkpoint import load_sharded, save_pretrained
    from shardformer.core.compare import compare_params
    from shardformer.core.inputs import make_inputs
    from shardformer.data_parallel import ZeroOptimizer
    from shardformer.tensor_parallel.slicer import shard_spec

    model = factory("GPTBigCodeForCausalLM")()
    ref = copy.deepcopy(model)
    shard_model(model, ShardConfig(tensor_parallel_size=2))
    group = sharding_of(model).tp_group
    c_attn = model.transformer.h[0].attn.c_attn
    out = {"splits": shard_spec(c_attn.weight).splits, "local": tuple(c_attn.weight.shape)}
    inputs = make_inputs(ref, seed=3)
    ref(**inputs).loss.backward()
    model(**inputs).loss.backward()
    out["grads"] = [(d.name, d.ok) for d in compare_params(ref, model, group, grads=True) if not d.ok]
    full_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]  # dp = 1
    zero = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), dp_group=alone, tp_group=group)
    out["norms"] = (zero.clip_grad_norm(1e9), full_norm)
    zero.step()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    save_pretrained(model, tmp)
    exported = tf.GPTBigCodeForCausalLM.from_pretrained(tmp)
    out["export"] = max((a - b).abs().max().item() for a, b in zip(exported.parameters(), ref.parameters()))
    loaded = load_sharded("GPTBigCodeForCausalLM", tmp, ShardConfig(tensor_parallel_size=2))
    out["load"] = max((a - b).abs().max().item() for a, b in zip(loaded.parameters(), model.parameters()))
    out["rank"] = dist.get_rank()
    return out


def test_fewer_key_value_heads_than_ranks_are_replicated(tmp_path):
    for out in run_on_ranks(_replicated_kv, 2, str(tmp_path)):
        assert out["splits"] == (2, 1, 1) and out["local"] == (16 + 8 + 8, 32), out  # [Q_r | K | V]
        assert out["grads"] == [], out["grads"]
        norm, full = out["norms"]
        assert abs(norm - full) < 1e-5 * full, out["norms"]
        assert out["export"] < 1e-6 and out["load"] == 0.0, out


def test_a_plan_policy_with_no_tower_policy_refuses_the_tower_it_leaves_whole():
    import pytest

    from shardformer import ShardConfig
    from shardformer.policies.tp_plan import TpPlanPolicy, UnsupportedStyleError

    model = transformers_model("LlavaForConditionalGeneration")
    policy = TpPlanPolicy()  # by hand: no tower policy (get_autopolicy gives DerivedPolicy)
    policy.set_model(model)
    with pytest.raises(UnsupportedStyleError, match="leaves model.vision_tower whole"):
        policy.argument_policy(model.config, ShardConfig(tensor_parallel_size=2))
    assert get_autopolicy(model).tower_policy is DerivedPolicy


def test_nothing_is_derived_at_tp1(monkeypatch):
    """At tensor_parallel_size=1 (dp- or cp-only) a derived-route model is not cut, not even derived: GPT-OSS
    failed dividing a count that is None by tp. It computes what the unsharded model computes."""
    import copy

    from shardformer import ShardConfig, shard_model
    from shardformer.core.inputs import make_inputs
    from shardformer.policies.derived import policy as derived_policy

    calls = []
    monkeypatch.setattr(derived_policy, "derive", lambda *a, **k: calls.append(a) or derive(*a, **k))
    model = transformers_model("GptOssForCausalLM")
    assert type(get_autopolicy(model)) is DerivedPolicy
    ref = copy.deepcopy(model)
    model = shard_model(model, ShardConfig(tensor_parallel_size=1))
    assert not calls
    inputs = make_inputs(ref, seed=2)
    got, want = model(**inputs), ref(**inputs)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)


def test_a_tower_no_forward_runs_stays_whole_with_a_word(caplog, monkeypatch):
    """A tower the tiny model's forward never reaches and that runs on no inputs of its own (Qwen 3.5's
    token classifier holds its base model's vision tower and takes no images): no cut of it can be derived
    or proven, and whole it computes what it computes unsharded, so the plan route cuts the rest and says
    so, rather than refusing the class. Here Llava given text only stands for it."""
    from shardformer import ShardConfig
    from shardformer.core.comm import VirtualGroup
    from shardformer.policies.derived import tiny_inputs
    from shardformer.tensor_parallel.sharder import ModelSharder

    text_only = {"input_ids": torch.ones(2, 8, dtype=torch.long)}
    monkeypatch.setattr(tiny_inputs, "make_inputs", lambda model, seed=0: dict(text_only))
    monkeypatch.setattr(tiny_inputs, "instance_copy", lambda model, tp, heads=None: model)  # tiny already
    model = transformers_model("LlavaForConditionalGeneration")
    sharder = ModelSharder(model, get_autopolicy(model), ShardConfig(tensor_parallel_process_group=VirtualGroup(0, 2)))
    cut = [r.path for r in sharder.plan().replacements]
    assert cut and not [p for p in cut if p.startswith("model.vision_tower.")]
    assert "model.vision_tower (CLIPVisionModel) is not run by a forward" in caplog.text


def test_a_column_cut_by_heads_offers_its_blocks_widths_as_attributes():
    """Exaone 4.5's vision attention splits its fused qkv by the ``q_dim`` and ``kv_dim`` it holds: with fewer
    key/value heads its blocks are sized by the heads, and each block's width is a candidate to divide."""
    from types import SimpleNamespace

    from shardformer.policies.derived.column_cuts import block_widths, column_candidates

    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, hidden_size=32)  # q 32, k and v 16
    options = column_candidates(64, config, 2)
    assert ("heads",) in options and block_widths(64, options, config) >= {32, 16}


def test_a_partial_parameter_beside_a_whole_one_is_summed_by_name():
    """VideoPrism's pooling head holds its query (read by the cut query projection: a whole gradient) and a
    per-dimension scale applied on this rank's heads (a partial one): only the scale is summed over tp."""
    from types import SimpleNamespace

    from shardformer.policies.derived.derive import BlockRule
    from shardformer.policies.derived.partial_grads import partial_modules
    from shardformer.policies.tp_plan.styles import grad_all_reduce_of

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.query, self.scale = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(2))
            self.q, self.o = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    model = torch.nn.Sequential(Head())
    origins = {"0": {"q": frozenset({"0.query"}), "o": frozenset({"0.q.weight", "0.scale"})}}
    flows = SimpleNamespace(origins=origins, output_origins=frozenset(), blocks=[], heads=["0"])
    rules = {Head: BlockRule(cols={"q": 1}, rows={"o"})}
    assert partial_modules(model, flows, rules) == ({Head: {"scale"}}, set())
    summed = grad_all_reduce_of(("scale",))
    assert summed.sequence_parallel_exact_params(model[0]) == ["scale"] and vars(summed)["keeps_weights"]
