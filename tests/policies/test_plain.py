"""The derived route on models with no transformers config: timm models other than the ViT family's
own policy, and plain ``nn.Module``s with repeated blocks. Each is traced and proven on a copy with
two blocks per stack, then compared with the unsharded model by ``verify`` (outputs, loss or a fixed
projection, gradients, weights and outputs after an SGD step); refusals name their reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from shardformer import ShardConfig
from shardformer.core.example_inputs import give_example_inputs
from shardformer.core.inputs import make_inputs
from shardformer.core.instance import study_instance
from shardformer.core.refusal import HEADS
from shardformer.policies.copies import two_blocks
from shardformer.policies.derived import DerivedPolicy, derive
from shardformer.policies.derived.blocks import repeated_blocks
from shardformer.tools.testing import run_on_ranks
from tests.policies.plain_models import (
    PlainBlockNoEmbed,
    TorchEncoderLM,
    bare_encoder,
    conv_net,
    factory,
    linear_first,
    plain_lm,
    timm_model,
    torch_encoder_lm,
)

# BEiT, EVA-02 (fused qkv read through F.linear with q/v biases, and separate q/k/v) and Swin-V2 (its
# relative position MLP per head) take the setting that calls qkv, their biases cut with the [Q|K|V]
# blocks and the heads' merge to the input's width made this rank's width; ViT with registers takes
# the ViT family's own policy; EVA-02 base/large's LayerNorm over the MLP's cut hidden features sums
# its statistics over ranks
# nn.TransformerEncoder's nn.MultiheadAttention is cut by heads by its own layer; timm's ViT with an attention
# pooling head (global_pool="map") takes the ViT family's policy, and its AttentionPoolLatent the derived cut;
# ConvNeXt with its MLP channels-last (conv_mlp=False): fc1 -> fc2 cut as any MLP, read off its [B, C, H, W] stream;
# a convolutional network (conv_net) cut over channels
EXACT = [
    "plain", "torch_encoder", "linear_first", "deit", "swin", "beit", "eva02", "eva02_fused", "eva02_base", "swinv2", "vit_reg",
    "vit_map", "convnext", "conv_net",
]  # fmt: skip
BUILT_IN = {"vit_reg", "vit_map"}
# CaiT's self-attention mixes its heads (talking heads): refused naming the projections; a small MViT
# built for 32-pixel images does not run on the recipe's (224): refused saying so, with its inputs' shapes
REFUSED = ["cait", "mix_heads", "bare_encoder", "mvit"]


def test_repeated_blocks_of_plain_and_timm_models():
    assert repeated_blocks(plain_lm()) == ["blocks.0", "blocks.1", "blocks.2"]
    # Swin's stages (a Sequential of stages, each with its own Sequential of blocks): the blocks
    swin = repeated_blocks(timm_model("swin"))
    assert swin == [
        "layers.0.blocks.0",
        "layers.0.blocks.1",
        "layers.1.blocks.0",
        "layers.1.blocks.1",
        "layers.1.blocks.2",
    ]
    copy = two_blocks(timm_model("swin"))
    assert [len(stage.blocks) for stage in copy.layers] == [2, 2]  # each stack cut to two, the stages kept
    # stages that are themselves Sequentials of blocks, the first item of a stage unlike the rest (a
    # downsampling layer, as CSATv2's): the blocks inside are the repeated ones, each found once
    stages = nn.Sequential(
        nn.Sequential(PlainBlockNoEmbed(8), PlainBlockNoEmbed(8)),
        nn.Sequential(nn.Linear(8, 16), PlainBlockNoEmbed(16), PlainBlockNoEmbed(16)),
    )
    assert repeated_blocks(nn.Sequential(stages)) == ["0.0.0", "0.0.1", "0.1.1", "0.1.2"]
    # a ModuleList of such stacks (Twins', VOLO's): the same; a stack of layers that each hold a stack
    # of experts is a stack of layers
    assert repeated_blocks(nn.ModuleList(stages)) == ["0.0", "0.1", "1.1", "1.2"]
    layers = nn.ModuleList(nn.ModuleDict({"experts": nn.ModuleList(stages[0])}) for _ in range(2))
    assert repeated_blocks(nn.Sequential(layers)) == ["0.0", "0.1"]


def test_plain_inputs_are_token_ids_or_refused():
    inputs = make_inputs(plain_lm(), seed=0)
    assert list(inputs) == ["tokens"] and inputs["tokens"].max() < 96
    assert list(make_inputs(timm_model("deit"), seed=0)) == ["x"]
    import timm

    # no patch embedding to read the size from: the size the model was built for (its pretrained_cfg)
    assert make_inputs(timm.create_model("test_convnext"), seed=0)["x"].shape == (2, 3, 160, 160)
    # a Linear first: float features as wide as it reads; a convolution first: images with its channels
    assert make_inputs(linear_first(), seed=0)["input"].shape == (2, 8, 16)
    assert make_inputs(nn.Sequential(nn.Conv2d(5, 4, 3), nn.Flatten()), seed=0)["input"].shape == (2, 5, 16, 16)
    with pytest.raises(ValueError, match="cannot make inputs for TransformerEncoder") as refused:
        make_inputs(bare_encoder(), seed=0)
    assert str(refused.value).startswith("Pass the forward's inputs as example_inputs: shard_model(model, ShardConfig(")


def test_example_inputs_are_used_cut_to_the_batch_and_keyed():
    """Given inputs bind to the forward's names, the batch is cut (or repeated) where it is plain, a square
    mask over a sequence-first input is left as given, and the instance key changes with them."""
    model = bare_encoder()
    before = study_instance(model).key
    src, mask = torch.randn(10, 4, 32), torch.zeros(10, 10)
    give_example_inputs(model, (src,))
    given = make_inputs(model, seed=0)
    assert list(given) == ["src"] and torch.equal(given["src"], src[:2]), given
    assert make_inputs(model, seed=0, batch=12)["src"].shape == (12, 4, 32)  # repeated to the batch asked
    assert study_instance(model).key != before
    give_example_inputs(model, {"src": src, "mask": mask})
    assert make_inputs(model, seed=0)["mask"].shape == (10, 10)  # 10 is also the mask's width: left as given
    with pytest.raises(TypeError, match=r"example_inputs do not fit TransformerEncoder.forward\(src"):
        give_example_inputs(model, {"source": src})
    with pytest.raises(TypeError, match="ShardConfig.example_inputs=Tensor must be a dict"):
        ShardConfig(example_inputs=src)


def test_rules_are_read_off_the_dataflow():
    rule = derive(plain_lm(), 2).rules[type(plain_lm().blocks[0])]
    assert rule.cols == {"attn.q": 1, "attn.k": 1, "attn.v": 1, "fc1": 1} and rule.rows == {"attn.o", "fc2"}
    assert rule.divide == {"attn.heads"}
    swin = derive(timm_model("swin"), 2)
    (rule,) = swin.rules.values()
    assert rule.cols == {"attn.qkv": 3, "mlp.fc1": 1} and rule.divide == {"attn.num_heads"}
    assert rule.head_params == {"attn": {"relative_position_bias_table": 1}}  # [positions, heads]: cut by heads


def test_beit_and_swin_v2_rules_call_qkv_and_cut_its_biases_with_it():
    (rule,) = derive(timm_model("beit"), 2).rules.values()
    assert rule.settings == {"attn.qkv_bias_separate": True}  # F.linear(x, qkv.weight, ...) -> self.qkv(x) + bias
    assert rule.cols == {"attn.qkv": 3, "mlp.fc1": 1} and rule.divide == {"attn.num_heads"}
    assert rule.head_params == {"attn": {"relative_position_bias_table": 1, "q_bias": 0, "v_bias": 0, "k_bias": 0}}
    assert rule.local_widths == {"attn": "attn.proj"}  # reshape(B, N, C): C / tp on a rank
    (rule,) = derive(timm_model("eva02_base"), 2).rules.values()
    assert rule.split_norms == {"mlp.norm"} and rule.cols["mlp.fc1_g"] == rule.cols["mlp.fc1_x"] == 1
    (rule,) = derive(timm_model("swinv2"), 2).rules.values()
    assert rule.cols["attn.cpb_mlp.2"] == 1  # the per-head relative position MLP's output, cut by heads
    assert rule.head_params["attn"]["logit_scale"] == 0


def test_pooling_heads_are_modules_beside_the_stacks_with_attention_inside():
    from shardformer.policies.derived.blocks import pooling_heads

    assert pooling_heads(timm_model("vit_map")) == ["attn_pool"]  # AttentionPoolLatent: q, kv, proj, MLP
    assert pooling_heads(timm_model("deit")) == []  # classifier Linears are no heads
    assert pooling_heads(torch_encoder_lm()) == []  # the MultiheadAttention modules are inside the blocks


def test_local_widths_rewrite_only_the_reshape_that_cannot_fit():
    from shardformer.policies.derived.widths import LocalWidths, local_sizes

    t = torch.zeros(2, 2, 5, 8)  # [B, heads on this rank, N, head width] of 4 heads, C = 32
    assert local_sizes(t, [2, 5, 32], 32, 2) == [2, 5, 16]
    assert local_sizes(t, [2, 5, 16], 32, 2) is None  # fits as written
    assert local_sizes(t, [2, 5, -1], 32, 2) is None
    assert local_sizes(t, [4, 5, 32], 32, 2) is None  # the sizes hold this many elements already
    with LocalWidths(32, 2):
        assert t.transpose(1, 2).reshape(2, 5, 32).shape == (2, 5, 16)
        assert t.view((2, 2, 40)).shape == (2, 2, 40)
    # BLIP splits its fused qkv by the head count (left whole) and the input's width over it: the count made local
    qkv = torch.zeros(2, 5, 48)  # [B, N, 3 x 2 heads x 8] of 4 heads on 2 ranks
    assert local_sizes(qkv, [2, 5, 3, 4, 8], 32, 2, heads=(4,)) == [2, 5, 3, 2, 8]
    assert local_sizes(qkv, [2, 5, 3, 4, 8], 32, 2) is None  # no head count given: left as written
    with LocalWidths(32, 2, heads=(4,)):
        assert qkv.reshape(2, 5, 3, 4, 8).shape == (2, 5, 3, 2, 8)


def test_a_convolutional_network_is_cut_over_channels_where_exact():
    """Column convolutions by output channels, the per-channel work between (batch norm, the depthwise
    convolution, a per-channel scale) with them, the squeeze-excitation's expansion a column too (its gate
    multiplies the cut channels), rows reading them; what the stem writes reaches the head whole (flatten)."""
    from shardformer.policies.derived import NotDerivableError
    from shardformer.policies.derived.channels import channel_cut
    from shardformer.policies.derived.policy import derived_model

    model = conv_net().eval()
    cut = channel_cut(model, make_inputs(model, seed=0), 2)
    assert (cut.columns, cut.rows, cut.groups) == (["3.expand", "3.se_expand"], ["3.project", "3.se_reduce"], ["3.dw"])
    assert cut.tensors == {
        "3.bn": dict.fromkeys(["weight", "bias", "running_mean", "running_var"], 0),
        "3": {"scale": 0},
    }
    assert "flatten reads them" in cut.whole["0"], cut.whole
    # channels normalised in groups and read by the head: nothing to cut; refused naming why, pointing at dp
    model = conv_net(cut=False)
    assert derived_model(model)  # tried, to say why not
    policy = DerivedPolicy()
    policy.set_model(model)
    with pytest.raises(NotDerivableError, match=r"data parallelism(.|\n)*0: torch's group_norm reads them"):
        policy.argument_policy(None, ShardConfig(tensor_parallel_size=2))


def test_heads_that_tp_does_not_split_are_named(monkeypatch):
    import timm

    from shardformer.policies.derived import simulate

    # EVA-02 tiny's 3 heads at tp=2: no cut of its attention is exact, and the refusal says why, after
    # the first candidate (not the ~200 others: Swin's rows took a minute to say the same)
    tried = []
    run_ranks = simulate._run_ranks
    monkeypatch.setattr(simulate, "_run_ranks", lambda *a, **k: tried.append(a[1]) or run_ranks(*a, **k))
    model = timm.create_model("eva02_tiny_patch14_224", pretrained=False, img_size=28, depth=2)
    (why,) = set(derive(model, 2).refused)
    assert tried.count("proj") == 2, tried  # one candidate in each of the two blocks
    assert (
        "EvaBlock: attn.qkv -> attn.proj: attn.num_heads=3: its heads do not split over tensor_parallel_size=2" in why
    )
    assert why.fix == HEADS  # the refusal's first line: another tensor_parallel_size, not a Policy
    # one query head (Segformer's, PVT's first stage; kept, not read: the code reads head_dim) is no
    # key/value head to replicate: named too
    attention = torch.nn.Linear(4, 4)
    attention.num_attention_heads, attention.num_key_value_heads = 1, 1
    unsplit = simulate._unsplit_heads(torch.nn.ModuleDict({"attention": attention}), "blocks.0", 2)
    why = simulate._why_none(unsplit, 2, "the first candidate")
    assert why.startswith("blocks.0.attention.num_attention_heads=1: its heads do not split over"), why


def test_torch_transformer_encoder_cuts_multihead_attention_by_heads():
    model = torch_encoder_lm()
    assert repeated_blocks(model) == ["encoder.layers.0", "encoder.layers.1", "encoder.layers.2"]
    (rule,) = derive(model, 2).rules.values()
    assert rule.attention == {"self_attn"} and rule.cols == {"linear1": 1} and rule.rows == {"linear2"}
    torch.manual_seed(0)
    odd = TorchEncoderLM(dim=24)  # 4 heads of 6 at tp=3: fine; at tp=8 they do not split
    assert any("4 heads do not split over tensor_parallel_size=8" in r for r in derive(odd, 8).refused)


def _multihead_matches() -> float:
    """torch's nn.MultiheadAttention (sequence first, masks, averaged weights) against its tp cut: the
    largest difference of outputs, weights and the input's gradient."""
    import copy

    import torch.distributed as dist

    from shardformer.tensor_parallel.layers.multihead import ParallelMultiheadAttention

    torch.manual_seed(0)
    whole = torch.nn.MultiheadAttention(32, 4)
    cut = ParallelMultiheadAttention.from_native(copy.deepcopy(whole), dist.group.WORLD)
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
    padding = torch.tensor([[False] * 5 + [True], [False] * 6])
    worst = 0.0
    for need_weights, mask in ((True, causal), (False, causal.float() * -1e4)):
        results = []
        for module in (whole, cut):
            x = torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
            out, weights = module(x, x, x, key_padding_mask=padding, need_weights=need_weights, attn_mask=mask)
            out.square().sum().backward()
            results.append((out, x.grad, weights))
        for a, b in zip(*results):
            worst = max(worst, 0.0 if a is None and b is None else (a - b).abs().max().item())
    return worst


def _ranks(exact, refused):
    import torch.distributed as dist

    from shardformer import ShardConfig, shard_model
    from shardformer.policies.derived import NotDerivableError
    from shardformer.tools.verify import verify_on_this_rank
    from tests.policies.derived_models import factory as derived_factory
    from tests.policies.derived_models import transformers_model

    out = {}
    for name in exact:
        report = verify_on_this_rank(factory(name))
        out[name] = (report.ok, report.format())
    model = plain_lm()
    blocks = sum(p.numel() for p in model.blocks.parameters())
    shard_model(model, ShardConfig(tensor_parallel_size=dist.get_world_size()))
    out["plain blocks ratio"] = sum(p.numel() for p in model.blocks.parameters()) / blocks
    out["plain embedding"] = type(model.embed).__name__  # the token ids' embedding, vocab-parallel
    # CLIP's text token embedding (no LM head shares it) is vocab-parallel; its position embedding stays whole
    clip = transformers_model("CLIPModel")
    shard_model(clip, ShardConfig(tensor_parallel_size=dist.get_world_size()))
    embeddings = clip.text_model.embeddings
    out["clip embeddings"] = (type(embeddings.token_embedding).__name__, type(embeddings.position_embedding).__name__)
    out["beit export"] = _export_reloads_into_timm("beit")
    vit = timm_model("vit_map")
    pool = sum(p.numel() for p in vit.attn_pool.parameters())
    shard_model(vit, ShardConfig(tensor_parallel_size=dist.get_world_size()))
    out["vit_map pool ratio"] = sum(p.numel() for p in vit.attn_pool.parameters()) / pool
    rule = derive(timm_model("vit_map"), dist.get_world_size()).rules[type(vit.attn_pool)]  # cached: no new trace
    out["vit_map rule"] = (rule.cols, rule.rows, rule.divide, rule.local_widths)
    report = verify_on_this_rank(derived_factory("SiglipModel"))  # its logits read the pooling head's output
    out["siglip"] = (report.ok, report.format())
    out["siglip vision"] = _pooled_output_matches("SiglipVisionModel")
    out["wrong head"] = _wrong_head_is_refused()
    out["multihead"] = _multihead_matches()
    out["bare encoder"] = _bare_encoder_with_example_inputs()
    builds = {"mix_heads": lambda: plain_lm(mix_heads=True), "bare_encoder": bare_encoder}
    for name in refused:
        try:
            shard_model(builds.get(name, factory(name))(), ShardConfig(tensor_parallel_size=2))
            out[name] = "sharded"
        except (NotDerivableError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _bare_encoder_with_example_inputs() -> tuple:
    """nn.TransformerEncoder alone at tp=2, proven on the example inputs given: outputs (training, and eval's
    fused path) and every gradient equal to the unsharded encoder's."""
    import copy

    import torch.distributed as dist

    from shardformer import shard_model
    from tests.helpers import assert_close, assert_grads_match

    model = bare_encoder()
    ref = copy.deepcopy(model)
    src = torch.randn(10, 4, 32, generator=torch.Generator().manual_seed(1))
    shard_model(model, ShardConfig(tensor_parallel_size=dist.get_world_size(), example_inputs=(src,)))
    model(src).square().sum().backward()
    ref(src).square().sum().backward()
    assert_close(model(src), ref(src), what="training outputs")
    assert_grads_match(model, ref)
    with torch.no_grad():
        assert_close(model.eval()(src), ref.eval()(src), what="eval outputs")
    info = model.shardformer
    return info.route, info.proven, type(model.layers[0].self_attn).__name__


def _pooled_output_matches(name: str) -> dict:
    """A transformers model sharded against its unsharded copy through its pooled output (SigLIP's
    attention pooling head; ``verify`` compares the first output, the last hidden states): the largest
    differences of the pooled output, of every gradient and of the weights after an SGD step, how many
    of the head's parameters had gradients, and the fraction of the head's parameters this rank holds."""
    import copy

    import torch.distributed as dist

    from shardformer import ShardConfig, shard_model
    from shardformer.core.compare import compare_params
    from shardformer.models import inputs_for
    from tests.policies.derived_models import transformers_model

    ref = transformers_model(name)
    sharded = copy.deepcopy(ref)
    path = next(n for n, m in ref.named_modules() if type(m).__name__.endswith("PoolingHead"))
    head = sum(p.numel() for p in ref.get_submodule(path).parameters())
    shard_model(sharded, ShardConfig(tensor_parallel_size=dist.get_world_size()))
    pixels = inputs_for(ref, 1)["pixel_values"]
    pooled = [m(pixel_values=pixels).pooler_output for m in (ref, sharded)]
    weights = torch.randn(pooled[0].shape, generator=torch.Generator().manual_seed(2))
    for out in pooled:
        (out * weights).sum().backward()
    grads = compare_params(ref, sharded, dist.group.WORLD, grads=True)
    for m in (ref, sharded):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    after = compare_params(ref, sharded, dist.group.WORLD, grads=False)
    return {
        "pooled": (pooled[0] - pooled[1]).abs().max().item(),
        "grads ok": all(d.ok for d in grads),
        "head grads": sum(d.name.startswith(f"{path}.") for d in grads),
        "weights ok": all(d.ok for d in after),
        "head ratio": sum(p.numel() for p in sharded.get_submodule(path).parameters()) / head,
        "attention": type(sharded.get_submodule(f"{path}.attention")).__name__,
    }


def _wrong_head_is_refused() -> str:
    """The proof of SiglipVisionModel with its pooling head's attention computing 1% off (a wrapped
    forward): refused, though the last hidden states (its first output) are right."""
    from shardformer import ShardConfig, shard_model
    from shardformer.tensor_parallel.layers.multihead import ParallelMultiheadAttention
    from tests.policies.derived_models import transformers_model

    right = ParallelMultiheadAttention.forward

    def wrong(self, *args, **kwargs):
        out, weights = right(self, *args, **kwargs)
        return out * 1.01, weights

    ParallelMultiheadAttention.forward = wrong
    try:  # another config than the test's own (proofs are cached per architecture)
        shard_model(transformers_model("SiglipVisionModel", layer_norm_eps=1e-5), ShardConfig(tensor_parallel_size=2))
        return "sharded"
    except ValueError as e:
        return str(e)
    finally:
        ParallelMultiheadAttention.forward = right


def _export_reloads_into_timm(name: str) -> float | None:
    """BEiT sharded, one SGD step, exported: the largest output difference of ``timm.create_model(...)``
    loading the export against the sharded model (rank 0; None elsewhere)."""
    import os

    import torch.distributed as dist
    from safetensors.torch import load_file

    from shardformer import ShardConfig, shard_model
    from shardformer.checkpoint import save_pretrained
    from tests.checkpoint.common import remove_dir, sgd_steps, shared_dir

    model = shard_model(timm_model(name), ShardConfig(tensor_parallel_size=dist.get_world_size()))
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    sgd_steps(model, images, lambda m, x: m(x).square().mean(), steps=1)
    with torch.no_grad():
        out = model.eval()(images)
    path = shared_dir()
    save_pretrained(model, path)
    error = None
    if dist.get_rank() == 0:
        plain = timm_model(name)  # the same architecture, its own random weights: all replaced by the export
        plain.load_state_dict(load_file(os.path.join(path, "model.safetensors")))
        with torch.no_grad():
            error = (plain.eval()(images) - out).abs().max().item()
    remove_dir(path)
    return error


def test_plain_and_timm_models_are_exact_or_refused():
    results = run_on_ranks(_ranks, 2, EXACT, REFUSED)
    out = results[0]
    for name in EXACT:
        ok, text = out[name]
        assert ok, text
        assert ("built-in policy route" if name in BUILT_IN else "derived route") in text, text
    assert 0.5 < out["plain blocks ratio"] < 0.52, out["plain blocks ratio"]  # norms and row biases whole
    assert out["plain embedding"] == "VocabParallelEmbedding1D"
    assert out["multihead"] < 1e-5, out["multihead"]
    assert out["beit export"] is not None and out["beit export"] < 1e-5, out["beit export"]  # timm's own layout
    assert out["clip embeddings"] == ("VocabParallelEmbedding1D", "Embedding"), out["clip embeddings"]
    assert "attn.proj_w reads attn.proj_l" in out["cait"] and "talking-heads" in out["cait"], out["cait"]
    assert "attn.k, attn.q, attn.v -> attn.o" in out["mix_heads"], out["mix_heads"]
    assert "Pass the forward's inputs as example_inputs" in out["bare_encoder"], out["bare_encoder"]
    assert out["bare encoder"] == ("derived", True, "ParallelMultiheadAttention"), out["bare encoder"]
    # the attention pooling heads are cut: timm's AttentionPoolLatent and SigLIP's (nn.MultiheadAttention, MLP)
    assert 0.5 < out["vit_map pool ratio"] < 0.52, out["vit_map pool ratio"]  # norms and row biases whole
    # the latent query's q and the [K | V] kv by heads, proj row-parallel; the MLP after proj reads its
    # all-reduced output (no residual around the attention): cut as any MLP; reshape(B, len, C): C / tp
    cols, rows, divide, local_widths = out["vit_map rule"]
    assert cols == {"q": 1, "kv": 2, "mlp.fc1": 1} and rows == {"proj", "mlp.fc2"}, out["vit_map rule"]
    assert "num_heads" in divide and local_widths == {"": "proj"}, out["vit_map rule"]
    assert out["siglip"][0] and "derived route" in out["siglip"][1], out["siglip"][1]
    vision = out["siglip vision"]
    assert vision["pooled"] < 1e-5 and vision["grads ok"] and vision["weights ok"], vision
    assert vision["head grads"] == 11 and 0.5 < vision["head ratio"] < 0.55, vision  # probe, norm, row biases whole
    assert vision["attention"] == "ParallelMultiheadAttention", vision
    assert "first diverging module: head.attention (ParallelMultiheadAttention)" in out["wrong head"], out["wrong head"]
    assert "MultiScaleVit does not run on the inputs shardformer makes for it (x: [2, 3, 224, 224]" in out["mvit"]
    assert "data parallelism" in out["mvit"] and "ZeRO" in out["mvit"] and "MViT" not in out["mvit"], out["mvit"]
    assert [results[1][n][0] for n in EXACT] == [True] * len(EXACT)  # rank 1 agrees


def test_cli_plans_any_timm_model_by_name(capsys):
    from shardformer.cli.main import main

    # EVA-02 small on the meta device: its two-block copy is built for real with random weights to derive the cut
    assert main(["plan", "timm:eva02_small_patch14_224", "--tp", "2", "--summary"]) == 0
    out = capsys.readouterr().out
    assert "Linear -> Linear1D_Col: 24 (e.g. blocks.0.attn.qkv)" in out and "(0.508)" in out, out
    # ViTamin: a VisionTransformer whose MLP the family's policy refuses; the plan takes the next route
    assert main(["plan", "timm:vitamin_small_224", "--tp", "2", "--summary"]) == 0
    assert "per tensor-parallel rank (0.534)" in capsys.readouterr().out
    assert main(["verify", "timm:eva02_smal", "--tp", "2"]) == 2  # refused before any process starts
    assert "timm has no model named 'eva02_smal' (similar: eva02_" in capsys.readouterr().err


def test_channels_summed_with_what_a_convolution_reading_them_writes_are_named():
    """TextNet's identity branch: a convolution's output summed with its own input. The same channels are read
    and written, so no convolution is their row; the refusal names that convolution and why."""
    from shardformer.policies.derived.channels import channel_cut

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem, self.conv = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3, padding=1)
            self.head = nn.Conv2d(8, 4, 1)

        def forward(self, x):
            h = self.stem(x)
            return self.head(h + self.conv(h)).mean((2, 3))

    cut = channel_cut(Residual(), {"x": torch.randn(2, 3, 8, 8)}, 2)
    assert cut.whole["stem"].startswith("conv reads them and its output is summed with them"), cut.whole
