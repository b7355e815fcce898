"""State-space mixers cut by channel at tp=2 against the unsharded model (``verify``: outputs, loss,
every gradient, the weights after a step, greedy generate), on transformers' PyTorch path (no
``mamba_ssm`` / ``causal_conv1d`` kernels here): Mamba (``x_proj`` a row whose all-reduced output
feeds each rank's channels; ``dt_proj``, the convolution, ``A_log`` and ``D`` read by weight and cut
with their channels), Mamba-2 with two groups (``in_proj``'s ``[z | x | B | C | dt]`` blocks, whole
groups per rank) and with one group at sizes unlike its tiny copy's (B and C whole on every rank, their
gradients summed; the gated norm's variance over the ranks; the layout read again at the model's own
widths), and the released hybrids' one-group layout: Bamba (one block class holding a Mamba-2 mixer or
attention), GraniteMoeHybrid and Falcon-H1 (with its optional gated norm on). Loaded with
``from_pretrained`` from saved tiny models whose per-channel and per-head tensors all differ (alike, a
rank given another channel's would compute the same). One spawn; the refusals need no ranks."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import transformers as tf

from shardformer import ShardConfig, shard_model
from shardformer.core.tiny import tiny_config
from shardformer.tools.testing import run_on_ranks
from tests.policies.derived_models import save_tiny

MAMBA2 = dict(hidden_size=32, num_heads=8, head_dim=8, state_size=16, chunk_size=8)  # inner width 64 = 8 x 8
WIDE = dict(hidden_size=64, num_heads=16, head_dim=8, state_size=12, chunk_size=8, n_groups=1)  # not the tiny copy's
BAMBA = dict(  # a hybrid: one block class, a Mamba-2 mixer in layer 0 and attention in layer 1
    hidden_size=32, mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=8,
    num_hidden_layers=2, attn_layer_indices=[1],
)  # fmt: skip
HYBRID = dict(mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=8)
MODELS = {
    "MambaForCausalLM": ("MambaForCausalLM", {}),
    "Mamba2ForCausalLM": ("Mamba2ForCausalLM", dict(MAMBA2, n_groups=2)),
    "Mamba2-one-group": ("Mamba2ForCausalLM", WIDE),
    "BambaForCausalLM": ("BambaForCausalLM", BAMBA),
    "GraniteMoeHybridForCausalLM": (
        "GraniteMoeHybridForCausalLM",
        dict(HYBRID, layer_types=["linear_attention", "full_attention"]),
    ),
    "FalconH1ForCausalLM": ("FalconH1ForCausalLM", dict(HYBRID, mamba_d_ssm=64, mamba_rms_norm=True)),
}
PER_CHANNEL = ("A_log", ".D", "dt_bias", "dt_proj", "conv1d", "mixer.norm", "mamba.norm")


def _distinct_channels(name: str, param) -> None:
    if any(part in name for part in PER_CHANNEL):
        param.add_(torch.randn_like(param) * 0.3)


def _ranks(folders: dict[str, tuple[str, str]]) -> dict:
    from shardformer.tools.verify import verify_on_this_rank

    out = {}
    for name, (cls_name, path) in folders.items():
        report = verify_on_this_rank(path, model_class=cls_name)
        out[name] = (report.ok, report.format())
    mamba = tf.MambaForCausalLM.from_pretrained(folders["MambaForCausalLM"][1])
    inner = mamba.config.intermediate_size
    shard_model(mamba, ShardConfig(tensor_parallel_size=2))
    mixer = mamba.backbone.layers[0].mixer
    out["mamba"] = (
        mamba.shardformer.route,
        type(mixer.x_proj).__name__,
        tuple(mixer.A_log.shape)[0] * 2 == inner,
        tuple(mixer.dt_proj.weight.shape)[0] * 2 == inner,
        mixer.conv1d.groups * 2 == inner,
    )
    mamba2 = tf.Mamba2ForCausalLM.from_pretrained(folders["Mamba2ForCausalLM"][1])
    heads, groups = mamba2.config.num_heads, mamba2.config.n_groups
    shard_model(mamba2, ShardConfig(tensor_parallel_size=2))
    mixer = mamba2.backbone.layers[0].mixer
    out["mamba2"] = (
        mamba2.shardformer.route,
        (mixer.num_heads * 2, mixer.n_groups * 2) == (heads, groups),
        tuple(mixer.dt_bias.shape)[0] * 2 == heads,
        mixer.norm.weight.shape[0] == mixer.intermediate_size,
    )
    one = tf.Mamba2ForCausalLM.from_pretrained(folders["Mamba2-one-group"][1])
    inner, state = one.config.num_heads * one.config.head_dim, one.config.state_size
    shard_model(one, ShardConfig(tensor_parallel_size=2))
    mixer = one.backbone.layers[0].mixer
    out["one group"] = (  # this rank's heads, B and C whole
        (mixer.n_groups, mixer.intermediate_size, mixer.conv_dim) == (1, inner // 2, inner // 2 + 2 * state),
        mixer.conv1d.weight.shape[0] == mixer.conv_dim,
        mixer.norm.group_size == inner // 2,
    )
    return out


def test_mamba_and_mamba2_mixers_are_cut_by_channel(tmp_path):
    folders = {}
    for name, (cls_name, options) in MODELS.items():
        folders[name] = (cls_name, str(tmp_path / name))
        save_tiny(cls_name, options, folders[name][1], _distinct_channels)
    for out in run_on_ranks(_ranks, 2, folders, timeout=600):
        for name in MODELS:
            ok, text = out[name]
            assert ok, text
        assert out["mamba"] == ("derived", "Linear1D_RowIntoParallel", True, True, True), out["mamba"]
        assert out["mamba2"] == ("derived", True, True, True), out["mamba2"]
        assert out["one group"] == (True, True, True), out["one group"]


def test_groups_tp_neither_divides_nor_is_one_are_refused_by_name():
    model = tf.Mamba2ForCausalLM(tiny_config(tf.Mamba2Config, **MAMBA2, n_groups=2))
    with pytest.raises(ValueError) as info:
        shard_model(model, ShardConfig(tensor_parallel_size=4))
    assert "n_groups=2" in str(info.value) and "tensor_parallel_size=4" in str(info.value), info.value


def test_fused_kernels_that_read_whole_weights_are_refused_by_name(monkeypatch):
    """transformers' fused Mamba kernels read out_proj's weight themselves: with mamba_ssm importable, or
    the model loaded with use_kernels=True, the mixer cut would be silently wrong."""
    model = tf.Mamba2ForCausalLM(tiny_config(tf.Mamba2Config, **MAMBA2, n_groups=2))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "mamba_ssm" else find_spec(name, *a)
    )
    with pytest.raises(ValueError, match="mamba_ssm package is installed"):
        shard_model(model, ShardConfig(tensor_parallel_size=2))
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    model._use_kernels = True  # what from_pretrained(..., use_kernels=True) leaves (its setter would load the hub's)
    with pytest.raises(ValueError, match="use_kernels=True"):
        shard_model(model, ShardConfig(tensor_parallel_size=2))
