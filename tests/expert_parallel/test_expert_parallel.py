"""Expert parallelism against the unsharded model built from the same weights: each ep rank passes its
own batch, so outputs, loss and every non-expert gradient (the router's included) must be the unsharded
model's on that batch, and each expert's gradient the sum over every rank's batch. Then training through
ParallelEngine (ZeRO-1/2, clipping, with tp and with pp), export, generate, and the refusals. Two spawns.
"""

import tempfile

import pytest
import torch
import torch.distributed as dist
import transformers

from shardformer import EngineConfig, ParallelEngine, ShardConfig, shard_model
from shardformer.expert_parallel import ExpertParallelError
from shardformer.expert_parallel.layout import expert_params
from tests.expert_parallel.common import (
    batch,
    build,
    check_expert_grads,
    reference_grads,
    reference_steps,
)
from tests.helpers import assert_close, check_table


def _parity(name, tp=1, **config):
    ref, model = build(name, **config)
    model = shard_model(model, ShardConfig(tensor_parallel_size=tp, expert_parallel_size=2))
    info = model.shardformer
    assert info.experts is not None and info.experts.proven, info.experts
    local = model.get_submodule(info.experts.paths[0])
    assert local.num_experts == 2 and all(p.expert_spec.local == 2 for p in expert_params(local).values())
    ep_rank = info.mesh.ep_rank
    batches = [batch(10 + r) for r in range(2)]
    out = model(**batches[ep_rank])
    out.loss.backward()
    total, own, ref_out = reference_grads(ref, batches, ep_rank)
    if tp == 1:
        assert_close(out.logits, ref_out.logits, what=f"{name} logits")
    assert_close(out.loss, ref_out.loss, what=f"{name} loss (with the router's load-balancing loss)")
    check_expert_grads(model, total, own, info.tp_group)
    return model


def check_mixtral_ep2():
    _parity("mixtral", output_router_logits=True)


def check_qwen3_moe_ep2():
    _parity("qwen3_moe", output_router_logits=True)


def check_deepseek_v3_ep2():  # shared experts (kept whole), grouped routing, a dense first layer
    model = _parity("deepseek_v3")
    assert model.shardformer.experts.paths == ("model.layers.1.mlp.experts",)
    assert not hasattr(model.model.layers[1].mlp.shared_experts.gate_proj.weight, "expert_spec")


def check_gpt_oss_ep2():  # expert biases, its own clamped gate; found from the structure (its ep plan agrees)
    _parity("gpt_oss", output_router_logits=True)


def check_dbrx_ep2_trains_and_exports():
    """DBRX keeps its experts flattened ([experts * ffn, hidden]) in a child module: each rank keeps its
    experts' rows; trained two steps (ZeRO-1: losses and every weight) and exported in the model's own layout."""
    ref, engine = _train("dbrx", steps=2, zero_stage=1)
    _same_weights(ref, engine.model, "dbrx")
    w1 = engine.model.transformer.blocks[0].ffn.experts.mlp.w1
    assert w1.shape == (2 * 24, 32) and w1.expert_spec.row_span == (dist.get_rank() * 48, dist.get_rank() * 48 + 48)
    folder = _shared_folder()
    engine.model.save_pretrained(folder)
    dist.barrier()
    back = transformers.AutoModelForCausalLM.from_pretrained(folder)
    for name, p in ref.named_parameters():
        assert_close(dict(back.named_parameters())[name], p, what=f"dbrx exported {name}")
    dist.barrier()


def check_jetmoe_ep2():  # four exchanges per layer: the attention's experts and the MLP's, in and out
    model = _parity("jetmoe", output_router_logits=True)
    assert len(model.shardformer.experts.paths) == 8, model.shardformer.experts.paths


def check_llama4_ep2():  # the shared expert kept whole on every rank, the routed experts split
    model = _parity("llama4", output_router_logits=True)
    moe = model.model.layers[0].feed_forward
    assert model.shardformer.experts.paths == (
        "model.layers.0.feed_forward.experts",
        "model.layers.1.feed_forward.experts",
    )
    assert moe.experts.gate_up_proj.shape[0] == 2 and not hasattr(moe.shared_expert.up_proj.weight, "expert_spec")


def _first_two_experts_only(router, _inputs, out):
    """The router's logits kept (the load-balancing loss reads them), but every token sent to experts 0
    and 1: the rank holding experts 2 and 3 receives no token."""
    logits = out[0]
    scores, index = torch.topk(torch.softmax(logits[:, :2].float(), dim=-1), 2, dim=-1)
    return logits, scores, index


def check_experts_that_receive_no_token():
    ref, model = build("mixtral")
    model = shard_model(model, ShardConfig(expert_parallel_size=2))
    for m in (ref, model):
        for layer in m.model.layers:
            layer.mlp.gate.register_forward_hook(_first_two_experts_only)
    batches = [batch(30 + r) for r in range(2)]
    rank = model.shardformer.mesh.ep_rank
    out = model(**batches[rank])
    out.loss.backward()
    total, own, ref_out = reference_grads(ref, batches, rank)
    assert_close(out.loss, ref_out.loss, what="loss")
    check_expert_grads(model, total, own)
    if rank == 1:  # its experts computed nothing, yet took part in both exchanges, forward and backward
        assert all(p.grad is not None and not p.grad.any() for p in model.model.layers[0].mlp.experts.parameters())


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _train(name, steps=3, size=4, **engine):
    ref, model = build(name, output_router_logits=True)
    data = [batch(20 + s, size=size) for s in range(steps)]
    cfg = EngineConfig(ep=2, num_microbatches=2, **engine)
    trained = ParallelEngine(model, _sgd, cfg)
    got = [trained.train_step(b) for b in data]
    expected = reference_steps(ref, data, trained.mesh.dp_size * 2, engine.get("max_grad_norm"))
    assert_close(torch.tensor(got), torch.tensor(expected), what=f"{name} {engine}: losses")
    return ref, trained


def _same_weights(ref, model, what):
    from shardformer.checkpoint.gather import gather_full_state

    full = gather_full_state(model)  # tp and ep gathered, stages merged: on rank 0
    if dist.get_rank() == 0:
        for name, p in ref.named_parameters():
            assert_close(full[name], p.detach(), what=f"{what}: {name} after the steps")


def check_engine_ep2_zero1_2_and_3_with_clipping():
    for zero in (1, 2, 3):
        ref, engine = _train("qwen3_moe", zero_stage=zero, max_grad_norm=0.3)
        _same_weights(ref, engine.model, f"zero={zero}")


def _shared_folder():
    box = [tempfile.mkdtemp(prefix="sf-ep-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_export_and_generate():
    ref, model = build("mixtral")
    model = shard_model(model, ShardConfig(expert_parallel_size=2))
    model.eval(), ref.eval()
    folder = _shared_folder()
    model.save_pretrained(folder)
    dist.barrier()
    back = transformers.AutoModelForCausalLM.from_pretrained(folder)  # plain transformers: the model's own layout
    assert back.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4
    for name, p in ref.named_parameters():
        assert_close(dict(back.named_parameters())[name], p, what=f"exported {name}")
    # greedy decoding of each rank's own prompt; rank 0 stops early on its EOS, rank 1 goes on
    prompts = [batch(40 + r, size=1)["input_ids"] for r in range(2)]
    rank = dist.get_rank()
    expected = ref.generate(prompts[rank], max_new_tokens=6, do_sample=False)
    ref.generation_config.eos_token_id = int(expected[0, -4]) if rank == 0 else None
    expected = ref.generate(
        prompts[rank],
        max_new_tokens=6,
        do_sample=False,
        eos_token_id=ref.generation_config.eos_token_id,
        pad_token_id=0,
    )
    got = model.generate(
        prompts[rank],
        max_new_tokens=6,
        do_sample=False,
        eos_token_id=ref.generation_config.eos_token_id,
        pad_token_id=0,
    )
    assert torch.equal(got, expected), (got, expected)
    dist.barrier()


def check_refusals():
    ref, model = build("mixtral")
    with pytest.raises(ValueError, match="expert_parallel_size=4 does not divide data_parallel_size=2"):
        shard_model(model, ShardConfig(expert_parallel_size=4))
    with pytest.raises(ValueError, match="precision='fp16' with ep=2"):
        EngineConfig(ep=2, precision="fp16")
    with pytest.raises(ValueError, match="EngineConfig.ep=3 does not divide data_parallel_size=2"):
        ParallelEngine(model, _sgd, EngineConfig(ep=3))
    dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4))  # fmt: skip
    with pytest.raises(ExpertParallelError, match="LlamaForCausalLM cannot be split by experts: it has no mixture"):
        shard_model(dense, ShardConfig(expert_parallel_size=2))
    switch = transformers.SwitchTransformersForConditionalGeneration(transformers.SwitchTransformersConfig(
        vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4, num_experts=4,
        num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, expert_capacity=3))  # fmt: skip
    with pytest.raises(ExpertParallelError, match=r"encoder.block.1.layer.1.mlp.experts \(SwitchTransformersExperts\) "
                       r"holds its 4 experts as one module each.*router encoder.block.1.layer.1.mlp.router "
                       r"\(SwitchTransformersTop1Router\) keeps at most expert_capacity=3 tokens"):  # fmt: skip
        shard_model(switch, ShardConfig(expert_parallel_size=2))
    _, odd = build("mixtral", num_local_experts=3)
    with pytest.raises(ExpertParallelError, match="holds 3 experts, which do not divide over expert_parallel_size=2"):
        shard_model(odd, ShardConfig(expert_parallel_size=2))


CHECKS_2 = [
    check_mixtral_ep2,
    check_qwen3_moe_ep2,
    check_deepseek_v3_ep2,
    check_gpt_oss_ep2,
    check_experts_that_receive_no_token,
    check_dbrx_ep2_trains_and_exports,
    check_jetmoe_ep2,
    check_llama4_ep2,
    check_engine_ep2_zero1_2_and_3_with_clipping,
    check_export_and_generate,
    check_refusals,
]


def check_mixtral_tp2_ep2():  # expert-internal tp (the plan's cut) inside each ep rank's experts
    _parity("mixtral", tp=2, output_router_logits=True)


def check_deepseek_tp2_ep2():
    _parity("deepseek_v3", tp=2)


def check_engine_tp2_ep2_zero1_with_activation_checkpointing():  # the recomputed forward exchanges again
    ref, engine = _train("mixtral", tp=2, zero_stage=1, max_grad_norm=0.3, activation_checkpointing=True)
    _same_weights(ref, engine.model, "tp=2 x ep=2")


def check_engine_cp2_ep2_zero2():  # each cp rank's chunk of the sequence routed; expert gradients summed over cp
    ref, model = build("mixtral")  # (a router loss over the whole batch is refused under cp)
    data = [batch(20 + s, size=4) for s in range(3)]
    engine = ParallelEngine(model, _sgd, EngineConfig(cp=2, ep=2, num_microbatches=2, zero_stage=2, max_grad_norm=0.3))
    got = [engine.train_step(b) for b in data]
    assert_close(torch.tensor(got), torch.tensor(reference_steps(ref, data, 4, 0.3)), what="cp=2 x ep=2: losses")
    _same_weights(ref, engine.model, "cp=2 x ep=2")


def check_engine_pp2_ep2_zero2():  # stage 0 holds DeepSeek's dense layer only: no experts there
    ref, engine = _train("deepseek_v3", pp=2, zero_stage=2, max_grad_norm=0.3)
    _same_weights(ref, engine.model, "pp=2 x ep=2")


def check_engine_dp4_ep2_zero1_and_zero3():
    """Two ranks hold each expert (expert-dp = 2): ZeRO-1 sums expert gradients over them, ZeRO-3 shards
    the experts over them; both divide by the whole dp."""
    for zero in (1, 3):
        ref, engine = _train("qwen3_moe", size=8, zero_stage=zero, max_grad_norm=0.3)
        assert engine.mesh.expert_dp_size == 2
        _same_weights(ref, engine.model, f"dp=4 x ep=2, zero={zero}")


CHECKS_4 = [
    check_engine_dp4_ep2_zero1_and_zero3,
    check_mixtral_tp2_ep2,
    check_deepseek_tp2_ep2,
    check_engine_tp2_ep2_zero1_with_activation_checkpointing,
    check_engine_pp2_ep2_zero2,
    check_engine_cp2_ep2_zero2,
]

test_ep2 = check_table(CHECKS_2, 2)
test_ep2_with_tp_or_pp = check_table(CHECKS_4, 4)
