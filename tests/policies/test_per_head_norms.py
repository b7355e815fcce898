"""Per-head q/k norms cut with the heads a rank holds, at tp=2 against the unsharded model (``verify``:
outputs, loss, every gradient, the weights after a step, greedy generate): StableLM's ``qk_layernorm``
(one LayerNorm per head in a ModuleList: the derived route shows each rank its heads' norms) and
Cohere's ``use_qk_norm`` (one norm weight ``[heads, head_dim]``: the tp plan cuts its rows with the
heads). Both with fewer key/value heads than query heads (the key norms follow the key/value heads),
loaded with ``from_pretrained`` from a saved tiny model whose norm weights all differ (alike, a norm
given another head's weights would compute the same). One spawn."""

from __future__ import annotations

import transformers as tf

from shardformer.tools.testing import run_on_ranks
from tests.policies.derived_models import save_tiny

MODELS = {
    "StableLmForCausalLM": dict(qk_layernorm=True),
    "CohereForCausalLM": dict(use_qk_norm=True),
}


def _distinct_norms(name: str, param) -> None:
    if "norm" in name:  # every head's norm its own weights
        param.normal_(1.0, 0.3)


def _ranks(folders: dict[str, str]) -> dict:
    from shardformer import ShardConfig, shard_model
    from shardformer.tools.verify import verify_on_this_rank

    out = {}
    for cls_name, path in folders.items():
        report = verify_on_this_rank(path, model_class=cls_name)
        out[cls_name] = (report.ok, report.format())
    stablelm = tf.StableLmForCausalLM.from_pretrained(folders["StableLmForCausalLM"])
    shard_model(stablelm, ShardConfig(tensor_parallel_size=2))
    attention = stablelm.model.layers[0].self_attn
    out["stablelm"] = (
        stablelm.shardformer.route,
        type(attention.q_layernorm.norms).__name__,
        len(attention.q_layernorm.norms),  # this rank's heads: 2 of 4 query heads, 1 of 2 key/value heads
        len(attention.k_layernorm.norms),
        len(list(attention.q_layernorm.parameters())),  # every head's norm stays registered
    )
    cohere = tf.CohereForCausalLM.from_pretrained(folders["CohereForCausalLM"])
    shard_model(cohere, ShardConfig(tensor_parallel_size=2))
    attention = cohere.model.layers[0].self_attn
    out["cohere"] = (
        cohere.shardformer.route,
        tuple(attention.q_norm.weight.shape),
        tuple(attention.k_norm.weight.shape),
    )
    return out


def test_per_head_norms_are_cut_with_their_heads(tmp_path):
    folders = {}
    for cls_name, options in MODELS.items():
        folders[cls_name] = str(tmp_path / cls_name)
        save_tiny(cls_name, options, folders[cls_name], _distinct_norms)
    for out in run_on_ranks(_ranks, 2, folders):
        for cls_name in MODELS:
            ok, text = out[cls_name]
            assert ok, text
        assert out["stablelm"] == ("derived", "HeadModules", 2, 1, 4), out["stablelm"]
        assert out["cohere"] == ("tp plan", (2, 8), (1, 8)), out["cohere"]
