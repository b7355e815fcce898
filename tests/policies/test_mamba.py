"""State-space mixers cut by channel at tp=2 against the unsharded model (``verify``: outputs, loss,
every gradient, the weights after a step, greedy generate), on transformers' PyTorch path (no
``mamba_ssm`` / ``causal_conv1d`` kernels here): Mamba (``x_proj`` a row whose all-reduced output
feeds each rank's channels; ``dt_proj``, the convolution, ``A_log`` and ``D`` read by weight and cut
with their channels), Mamba-2 (``in_proj``'s ``[z | x | B | C | dt]`` blocks, whole groups per rank)
and Bamba (a hybrid whose one block class holds a Mamba-2 mixer or attention). Loaded with
``from_pretrained`` from saved tiny models whose per-channel and per-head tensors all differ (alike, a
rank given another channel's would compute the same). One spawn; the refusal of ``n_groups`` that tp
does not divide needs no ranks."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from shardformer import ShardConfig, shard_model
from shardformer.core.tiny import tiny_config
from shardformer.tools.testing import run_on_ranks

MAMBA2 = dict(hidden_size=32, num_heads=8, head_dim=8, state_size=16, chunk_size=8)  # inner width 64 = 8 x 8
BAMBA = dict(  # a hybrid: one block class, a Mamba-2 mixer in layer 0 and attention in layer 1
    hidden_size=32, mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=8,
    num_hidden_layers=2, attn_layer_indices=[1],
)  # fmt: skip
MODELS = {"MambaForCausalLM": {}, "Mamba2ForCausalLM": dict(MAMBA2, n_groups=2), "BambaForCausalLM": BAMBA}
PER_CHANNEL = ("A_log", ".D", "dt_bias", "dt_proj", "conv1d", "mixer.norm")


def _save(cls_name: str, options: dict, path: str) -> None:
    cls = getattr(tf, cls_name)
    torch.manual_seed(0)
    model = cls(tiny_config(cls.config_class, **options))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(part in name for part in PER_CHANNEL):
                param.add_(torch.randn_like(param) * 0.3)
    model.save_pretrained(path)


def _ranks(folders: dict[str, str]) -> dict:
    from shardformer.tools.verify import verify_on_this_rank

    out = {}
    for cls_name, path in folders.items():
        report = verify_on_this_rank(path, model_class=cls_name)
        out[cls_name] = (report.ok, report.format())
    mamba = tf.MambaForCausalLM.from_pretrained(folders["MambaForCausalLM"])
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
    mamba2 = tf.Mamba2ForCausalLM.from_pretrained(folders["Mamba2ForCausalLM"])
    heads, groups = mamba2.config.num_heads, mamba2.config.n_groups
    shard_model(mamba2, ShardConfig(tensor_parallel_size=2))
    mixer = mamba2.backbone.layers[0].mixer
    out["mamba2"] = (
        mamba2.shardformer.route,
        (mixer.num_heads * 2, mixer.n_groups * 2) == (heads, groups),
        tuple(mixer.dt_bias.shape)[0] * 2 == heads,
        mixer.norm.weight.shape[0] == mixer.intermediate_size,
    )
    return out


def test_mamba_and_mamba2_mixers_are_cut_by_channel(tmp_path):
    folders = {}
    for cls_name, options in MODELS.items():
        folders[cls_name] = str(tmp_path / cls_name)
        _save(cls_name, options, folders[cls_name])
    for out in run_on_ranks(_ranks, 2, folders):
        for cls_name in MODELS:
            ok, text = out[cls_name]
            assert ok, text
        assert out["mamba"] == ("derived", "Linear1D_RowIntoParallel", True, True, True), out["mamba"]
        assert out["mamba2"] == ("derived", True, True, True), out["mamba2"]


def test_groups_tp_does_not_divide_are_refused_by_name():
    model = tf.Mamba2ForCausalLM(tiny_config(tf.Mamba2Config, **MAMBA2, n_groups=1))
    with pytest.raises(ValueError) as info:
        shard_model(model, ShardConfig(tensor_parallel_size=2))
    assert "n_groups=1" in str(info.value) and "tensor_parallel_size=2" in str(info.value), info.value
