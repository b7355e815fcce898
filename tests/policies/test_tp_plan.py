"""Policies derived from transformers' own tp plans, against the unsharded model from the same weights.

One spawn at tp=2 runs a representative subset (tiny models saved and loaded with from_pretrained):
logits (1e-5), loss, every gathered gradient (1e-4) and greedy generate. Refusals and the
block-wise slicer are checked in this process: they happen before any process group is needed.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import transformers as tf

from shardformer import ShardConfig, shard_model
from shardformer.core.tiny import tiny_config
from shardformer.policies.auto import get_autopolicy
from shardformer.policies.tp_plan import TpPlanPolicy, UnsupportedStyleError
from shardformer.tensor_parallel.layers import (
    Linear1D_Col,
    Linear1D_Row,
    VocabParallelEmbedding1D,
    VocabParallelLMHead1D,
)
from shardformer.tensor_parallel.slicer import make_spec, merge_shards, shard_spec, slice_tensor
from shardformer.tools.pair_check import compare, load_pair
from tests.helpers import GRAD_ATOL, GRAD_RTOL, check_table

SUBSET = {
    "LlamaForCausalLM": ("eager", "sdpa"),
    "MistralForCausalLM": ("eager",),
    "Qwen2ForCausalLM": ("eager",),
    "Qwen3ForCausalLM": ("sdpa",),
    "Gemma2ForCausalLM": ("eager",),
    "Phi3ForCausalLM": ("eager", "sdpa"),
    "GPTNeoXForCausalLM": ("eager",),
    "Olmo2ForCausalLM": ("sdpa",),
    "Starcoder2ForCausalLM": ("eager",),
    "GraniteForCausalLM": ("eager",),
    "MixtralForCausalLM": ("eager",),  # mixture of experts: stacked 3-D experts cut inside
    "Qwen3MoeForCausalLM": ("sdpa",),
}


def _parity(name, impl, **config):
    cls = getattr(tf, name)
    result = compare(cls, tiny_config(cls.config_class, **config), impl, new_tokens=4)
    assert not result.failures, f"{name}/{impl}: {result.failures}"
    assert result.vocab_parallel_logits, f"{name}/{impl}: a rank held full-vocabulary logits in training"


class _Parity:
    """A picklable parity check of one class under one attention implementation."""

    def __init__(self, name, impl):
        self.name, self.impl, self.__name__ = name, impl, f"check_{name}_{impl}"

    def __call__(self):
        _parity(self.name, self.impl)


def check_phi3_qkv_split_block_by_block():
    """Phi-3's fused qkv (4 query, 2 key/value heads of 8) is cut [Q_r | K_r | V_r]; no gather, no split."""
    cls = tf.Phi3ForCausalLM
    _, model = load_pair(cls, tiny_config(cls.config_class))
    model = shard_model(model, ShardConfig(tensor_parallel_size=2))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(attn.qkv_proj, Linear1D_Col) and not attn.qkv_proj.gather_output
    assert shard_spec(attn.qkv_proj.weight).blocks == (32, 16, 16)
    assert attn.qkv_proj.weight.shape[0] == 32
    assert isinstance(attn.o_proj, Linear1D_Row) and attn.o_proj.input_is_parallel
    assert attn.config.num_attention_heads == 2 and attn.num_key_value_heads == 1
    assert model.config.num_attention_heads == 4  # the model's own config stays global
    assert isinstance(mlp.gate_up_proj, Linear1D_Col) and mlp.gate_up_proj.n_cast == 2
    assert not mlp.gate_up_proj.gather_output and mlp.down_proj.input_is_parallel


def check_mixtral_experts_cut_inside_router_replicated():
    cls = tf.MixtralForCausalLM
    _, model = load_pair(cls, tiny_config(cls.config_class))
    model = shard_model(model, ShardConfig(tensor_parallel_size=2))
    moe = model.model.layers[0].mlp
    assert tuple(moe.experts.gate_up_proj.shape) == (4, 64, 32)  # [E, 2I / tp, H]: [gate_r | up_r]
    assert shard_spec(moe.experts.gate_up_proj).n_cast == 2 and shard_spec(moe.experts.gate_up_proj).dim == 1
    assert tuple(moe.experts.down_proj.shape) == (4, 32, 32) and shard_spec(moe.experts.down_proj).dim == 2
    assert shard_spec(moe.gate.weight) is None  # the router


def check_tied_llama_keeps_one_parameter():
    _parity("LlamaForCausalLM", "eager", tie_word_embeddings=True)
    cls = tf.LlamaForCausalLM
    _, model = load_pair(cls, tiny_config(cls.config_class, tie_word_embeddings=True))
    model = shard_model(model, ShardConfig(tensor_parallel_size=2))
    assert isinstance(model.model.embed_tokens, VocabParallelEmbedding1D)
    assert isinstance(model.lm_head, VocabParallelLMHead1D)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.shape[0] == 50  # vocabulary 99 padded to 100, half per rank


def check_qwen3_norm_gradients_are_summed_once_per_backward():
    """Two backwards accumulate: the q/k norm hooks sum each backward's gradient, not the running total."""
    cls = tf.Qwen3ForCausalLM
    ref, model = load_pair(cls, tiny_config(cls.config_class))
    model = shard_model(model, ShardConfig(tensor_parallel_size=2))
    ids = torch.randint(3, 99, (2, 6), generator=torch.Generator().manual_seed(2))
    for m in (ref, model):
        for _ in range(2):
            m(input_ids=ids, labels=ids).loss.backward()
    for name in ("q_norm", "k_norm"):
        got = getattr(model.model.layers[1].self_attn, name).weight.grad
        want = getattr(ref.model.layers[1].self_attn, name).weight.grad
        torch.testing.assert_close(got, want, atol=GRAD_ATOL, rtol=GRAD_RTOL)
    assert dist.get_world_size() == 2


def check_export_and_load_sharded_llama_phi3():
    """save_pretrained of a derived model gives a plain transformers folder (exact reload); load_sharded
    reads it slice by slice into what shard_model makes (Phi-3's qkv blocks included)."""
    from shardformer.checkpoint import load_sharded, save_pretrained
    from tests.checkpoint.common import remove_dir, shared_dir

    for name in ("LlamaForCausalLM", "Phi3ForCausalLM"):
        cls = getattr(tf, name)
        ref, model = load_pair(cls, tiny_config(cls.config_class))
        model = shard_model(model, ShardConfig(tensor_parallel_size=2))
        path = shared_dir()
        save_pretrained(model, path)
        dist.barrier()
        plain = cls.from_pretrained(path)
        assert type(plain) is cls
        ref_state = ref.state_dict()
        for key, value in plain.state_dict().items():
            assert torch.equal(value, ref_state[key]), f"{name}: {key} after export and reload"
        on_load = load_sharded(name, path, ShardConfig(tensor_parallel_size=2))
        remove_dir(path)
        expected = dict(model.named_parameters())
        for key, param in on_load.named_parameters():
            assert torch.equal(param, expected[key]), f"{name}: {key} loaded sharded"
            assert shard_spec(param) == shard_spec(expected[key]), key


def check_attention_dropout_masks_differ_per_rank_and_global_rng_stays():
    cls = tf.LlamaForCausalLM
    _, model = load_pair(cls, tiny_config(cls.config_class, attention_dropout=0.5))
    model = shard_model(model, ShardConfig(tensor_parallel_size=2)).train()
    ids = torch.randint(3, 99, (2, 6), generator=torch.Generator().manual_seed(2))
    attn = model.model.layers[0].self_attn
    seen = {}

    def keep_weights(module, args, out):
        seen.setdefault("weights", out[1].detach())

    attn.register_forward_hook(keep_weights)
    before = torch.get_rng_state()
    model(input_ids=ids)
    assert torch.equal(torch.get_rng_state(), before), "the caller's RNG stream moved"
    masks = [None, None]
    dist.all_gather_object(masks, seen["weights"] == 0)
    assert masks[0].any() and not torch.equal(masks[0], masks[1]), "ranks dropped the same positions"
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)  # eval: no swap, no error

    # activation checkpointing recomputes each layer with the same attention-dropout masks
    grads = []
    for recompute in (False, True):
        _, m = load_pair(cls, tiny_config(cls.config_class, attention_dropout=0.5))
        m = shard_model(m, ShardConfig(tensor_parallel_size=2)).train()
        if recompute:
            m.activation_checkpointing_enable()
        m(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def check_llama_and_phi3_issue_the_minimum_collectives():
    """Per layer 2 all-reduces forward (o_proj, down_proj) and 2 backward (the shared q/k/v input, the
    shared gate/up input; Phi-3's fused ones); + 1 embedding and 3 loss forward, 1 LM head input backward;
    Qwen3 adds one per q/k norm gradient (2 per layer)."""
    from shardformer.tensor_parallel.layers import CollectiveCounter

    for name, norms in (("LlamaForCausalLM", 0), ("Phi3ForCausalLM", 0), ("Qwen3ForCausalLM", 2)):
        cls = getattr(tf, name)
        _, model = load_pair(cls, tiny_config(cls.config_class))
        model = shard_model(model, ShardConfig(tensor_parallel_size=2))
        ids = torch.randint(3, 99, (2, 6), generator=torch.Generator().manual_seed(2))
        with CollectiveCounter() as fwd:
            out = model(input_ids=ids, labels=ids)
        with CollectiveCounter() as bwd:
            out.loss.backward()
        assert set(fwd.counts) | set(bwd.counts) <= {"all_reduce"}, (name, fwd.counts, bwd.counts)
        assert (len(fwd.calls), len(bwd.calls)) == (2 * 2 + 4, (2 + norms) * 2 + 1), (name, fwd.counts, bwd.counts)


def check_llama_base_and_classifier_heads():
    """Heads without an LM head: the embedding is still vocab-parallel, the rest as the plan says."""
    from tests.helpers import assert_close, assert_grads_match

    for name in ("LlamaModel", "LlamaForSequenceClassification"):
        cls = getattr(tf, name)
        ref, model = load_pair(cls, tiny_config(cls.config_class, num_labels=3))
        model = shard_model(model, ShardConfig(tensor_parallel_size=2))
        assert isinstance(model.get_input_embeddings(), VocabParallelEmbedding1D)
        ids = torch.randint(3, 99, (2, 6), generator=torch.Generator().manual_seed(2))
        kwargs = {"labels": torch.tensor([0, 2])} if name.endswith("Classification") else {}
        out, ref_out = model(input_ids=ids, **kwargs), ref(input_ids=ids, **kwargs)
        key = "logits" if kwargs else "last_hidden_state"
        assert_close(out[key], ref_out[key], what=f"{name} {key}")
        loss_of = (lambda o: o.loss) if kwargs else (lambda o: o.last_hidden_state.square().mean())
        loss_of(out).backward()
        loss_of(ref_out).backward()
        assert_grads_match(model, ref)


def check_gemma4_mlps_beside_heads_of_per_layer_widths():
    """Gemma-4's layers read their head width from a per-layer config (its own config gives none): the MLPs
    its plan splits have no heads, and the model is cut exactly (it was refused with a TypeError)."""
    from shardformer.tools.verify import verify_on_this_rank
    from tests.policies.derived_models import factory

    report = verify_on_this_rank(factory("runnable:Gemma4ForCausalLM"))
    assert report.ok and "TpPlanPolicy" in report.policy, report.format()


TP2 = [
    check_gemma4_mlps_beside_heads_of_per_layer_widths,
    check_llama_base_and_classifier_heads,
    check_llama_and_phi3_issue_the_minimum_collectives,
    *[_Parity(name, impl) for name, impls in SUBSET.items() for impl in impls],
    check_attention_dropout_masks_differ_per_rank_and_global_rng_stays,
    check_export_and_load_sharded_llama_phi3,
    check_phi3_qkv_split_block_by_block,
    check_tied_llama_keeps_one_parameter,
    check_mixtral_experts_cut_inside_router_replicated,
    check_qwen3_norm_gradients_are_summed_once_per_backward,
]
test_tp2 = check_table(TP2, 2)


# -- in this process: what is decided before any collective -----------------------------------


def _tiny(name, **config):
    cls = getattr(tf, name)
    torch.manual_seed(0)
    return cls(tiny_config(cls.config_class, **config))


def test_builtins_keep_precedence_and_plans_fill_in():
    assert type(get_autopolicy(_tiny("LlamaForCausalLM"))) is TpPlanPolicy
    assert type(get_autopolicy(tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=8, n_head=2)))).__name__ == (
        "GPT2LMHeadPolicy"
    )


def test_unsupported_style_is_refused_with_its_name_and_path():
    model = _tiny("LlamaForCausalLM")
    model.tp_plan = {**model.tp_plan, "model.layers.*.mlp.gate_proj": "sequence_parallel"}
    # the plan route on its own (with no policy given, the derived route would be tried next)
    with pytest.raises(UnsupportedStyleError, match=r"'sequence_parallel' at model.layers.0.mlp.gate_proj \(Linear\)"):
        shard_model(model, ShardConfig(tensor_parallel_size=2), TpPlanPolicy())


def test_kv_heads_that_neither_split_nor_replicate_are_refused_with_sizes():
    model = _tiny("LlamaForCausalLM", num_attention_heads=6, num_key_value_heads=3, hidden_size=48)
    with pytest.raises(ValueError, match=r"num_key_value_heads=3 neither divides by tensor_parallel_size=2"):
        shard_model(model, ShardConfig(tensor_parallel_size=2))


def test_widths_that_tp_does_not_divide_are_refused_before_any_group():
    model = _tiny("LlamaForCausalLM", intermediate_size=65)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj \(output features\): size 65"):
        shard_model(model, ShardConfig(tensor_parallel_size=2))


def test_unplanned_parameters_beside_split_heads_are_refused():
    model = _tiny("LlamaForCausalLM")
    model.model.layers[0].self_attn.extra = nn.Linear(4, 4)
    with pytest.raises(UnsupportedStyleError, match=r"model.layers.0.self_attn.extra \(Linear\) has parameters"):
        shard_model(model, ShardConfig(tensor_parallel_size=2), TpPlanPolicy())


@pytest.mark.parametrize("world", [1, 2, 4])
def test_blocks_of_different_sizes_slice_and_merge_back(world):
    full = torch.arange(48.0).view(24, 2)  # [Q: 16 | K: 4 | V: 4]
    specs = [make_spec(full.shape, 0, r, world, (16, 4, 4)) for r in range(world)]
    shards = [slice_tensor(full, s) for s in specs]
    if world == 2:
        assert torch.equal(shards[1], torch.cat([full[8:16], full[18:20], full[22:24]]))
    assert torch.equal(merge_shards(shards, specs[0]), full)


def test_blocks_that_tp_does_not_divide_are_refused():
    with pytest.raises(ValueError, match=r"fused blocks \(16, 3, 3\).*tensor_parallel_size=2"):
        make_spec((22, 2), 0, 0, 2, (16, 3, 3))


def test_plan_sizes_a_published_phi3_and_mixtral_at_tp2_pp2():
    from shardformer.tools.plan import build_meta_model, plan_model

    for name, fused in (("phi3-mini", "model.layers.0.self_attn.qkv_proj.weight"), ("mixtral-8x7b", None)):
        plan = plan_model(build_meta_model(name), tp=2, pp=2)
        full = sum(torch.Size(f).numel() for _, f, _ in plan.params)
        local = sum(torch.Size(r).numel() for _, _, r in plan.params)
        assert abs(local / full - 0.5) < 0.01, (name, local / full)
        assert len(plan.stages) == 2
        if fused:
            shapes = {n: (f, r) for n, f, r in plan.params}
            assert shapes[fused] == ((9216, 3072), (4608, 3072))  # [Q | K | V] cut block by block


def test_a_wrappers_inner_lm_head_is_the_head():
    """ShieldGemma 2's get_output_embeddings() asks its inner model's text decoder, which holds no head:
    the inner model's LM head is then the head, cut by vocabulary (padded), not as a plain projection."""

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = nn.Linear(4, 99)

        def get_output_embeddings(self):
            return self.lm_head

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.norm = Inner(), nn.LayerNorm(4)

        def get_output_embeddings(self):
            return None

    policy = TpPlanPolicy()
    policy.set_model(Wrapper())
    assert policy.head_path == "model.lm_head"


def test_a_fused_gate_up_planned_colwise_is_cut_as_two_halves():
    """Inkling's plans call the experts' fused ``gate_up_proj`` plain ``colwise`` (every other plan says
    ``packed_colwise``); its forward chunks it into gate and up, so each half is cut on its own: a plain cut
    would give one rank all of the gate and the other all of up (the sweep's 8e-2 mismatch)."""
    from shardformer.policies.tp_plan.experts import param_cut, stacked

    experts = nn.Module()
    experts.gate_up_proj = nn.Parameter(torch.zeros(4, 16, 8))
    experts.down_proj = nn.Parameter(torch.zeros(4, 8, 8))
    assert param_cut(experts, "gate_up_proj", "colwise", "experts") == (1, 2)
    assert param_cut(experts, "down_proj", "rowwise", "experts") == (2, 1)
    # Inkling's shared experts: stacked [n, I, H] weights under 'all_reduce', cut as experts are
    assert stacked(experts, {"gate_up_proj": "colwise", "down_proj": "rowwise"})
    experts.norm = nn.Parameter(torch.zeros(8))
    assert not stacked(experts, {"norm": "colwise"})  # a per-head parameter (a sink) is not
