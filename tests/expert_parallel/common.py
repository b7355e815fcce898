"""Tiny mixture-of-experts models for the expert-parallel tests, and the checks they share."""

import copy

import torch
import transformers

from shardformer.core.compare import GRAD_ATOL, GRAD_RTOL
from tests.helpers import assert_close, full_of

VOCAB, SEQ = 64, 8


def _config(name, **kw):
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    if name == "mixtral":
        return transformers.MixtralConfig(**common, **{"num_local_experts": 4, "num_experts_per_tok": 2, **kw})
    if name == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1,
            head_dim=8, **kw,
        )  # fmt: skip
    if name == "deepseek_v3":  # shared experts, grouped routing (2 groups, top-1 group), dense first layer
        common["num_key_value_heads"] = common["num_attention_heads"]  # latent attention: one key per head
        return transformers.DeepseekV3Config(
            **common, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=24,
            n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **kw,
        )  # fmt: skip
    if name == "gpt_oss":  # expert biases, its own gate, attention sinks
        return transformers.GptOssConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=4, **kw,
        )  # fmt: skip
    if name == "dbrx":  # experts flattened [experts * ffn, hidden] in a child module; rope_theta and clip_qkv
        return transformers.DbrxConfig(  # as its checkpoints set them (5.24's defaults do not build)
            vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
            attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
            ffn_config={"ffn_hidden_size": 24, "moe_num_experts": 4, "moe_top_k": 2}, **kw,
        )  # fmt: skip
    if name == "jetmoe":  # experts called with rows grouped by expert, in the MLP and in the attention
        return transformers.JetMoeConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_key_value_heads=2,
            kv_channels=8, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
            tie_word_embeddings=False, **kw,
        )  # fmt: skip
    if name == "llama4":  # every token to every routed expert (scaled), a shared expert beside them
        return transformers.Llama4TextConfig(
            **common, num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=48, head_dim=8,
            interleave_moe_layer_step=1, attention_chunk_size=8, **kw,
        )  # fmt: skip
    raise KeyError(name)


MODELS = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "dbrx", "jetmoe", "llama4")


def build(name, **kw):
    """(unsharded, copy to shard): the same weights, saved and loaded back through from_pretrained."""
    from tests.policies.zoo import load_twice

    config = _config(name, **kw)
    ref, model = load_twice(type(transformers.AutoModelForCausalLM.from_config(config)).__name__, config=config)
    ref.train(), model.train()
    return ref, model


def batch(seed, size=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def check_expert_grads(sharded, refs_total, refs_own, tp_group=None):
    """Expert gradients against the sum over every ep rank's batch; the rest against this rank's own."""
    for name, p in sharded.named_parameters():
        spec = getattr(p, "expert_spec", None)
        grad = full_of(p.grad, p, tp_group) if p.grad is not None else None
        expected = refs_total[name] if spec is not None else refs_own[name]
        if spec is not None and expected is not None:
            expected = spec.local_part(expected)
        if expected is None:
            assert grad is None or not grad.abs().max() > 0, name
            continue
        assert grad is not None, f"no gradient for {name}"
        assert_close(grad, expected, GRAD_ATOL, GRAD_RTOL, f"grad of {name}")


def reference_grads(ref, batches, rank):
    """(total over every batch, this rank's batch alone) gradients of the unsharded model, and its
    output and loss on this rank's batch."""
    ref = copy.deepcopy(ref)
    total, own, out = {}, {}, None
    for r, b in enumerate(batches):
        ref.zero_grad(set_to_none=True)
        o = ref(**b)
        o.loss.backward()
        for n, p in ref.named_parameters():
            if p.grad is not None:
                total[n] = total.get(n, 0) + p.grad
        if r == rank:
            own = {n: None if p.grad is None else p.grad.clone() for n, p in ref.named_parameters()}
            out = o
    total = {n: total.get(n) for n, _ in ref.named_parameters()}
    return total, own, out


def gathered_weights(model):
    """{name: full tensor} of every parameter (tp and ep gathered), the same on every rank."""
    from shardformer.checkpoint.gather import full_local_state

    return full_local_state(model)


def reference_steps(ref, data, chunks, max_grad_norm=None, lr=0.05):
    """One process, the unsharded model, SGD with momentum: each step's loss is the mean over ``chunks``."""
    from tests.pipeline.common import reference_run

    return reference_run(ref, data, chunks, max_grad_norm, optimizer=lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9))
