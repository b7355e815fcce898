"""`simulate_job`: each kind of rank of a 1024-rank job built for real on the meta device in a fake
process group; its bytes equal plan's formula and a hand count, its tp collectives Megatron's minimum."""

import pytest
import torch.distributed as dist
import transformers as tf

from shardformer.cli.main import main
from shardformer.tools.simulate import simulate_job

GIB = 2**30


def _adam_bytes(n, dp):
    return 12 * n // dp  # fp32 master + two fp32 moments of this rank's 1/dp shard


LLAMA_405B = tf.LlamaConfig(
    hidden_size=16384, num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
    intermediate_size=53248, vocab_size=128256, architectures=["LlamaForCausalLM"],
)  # fmt: skip


def test_llama3_405b_like_on_1024_ranks_matches_formula_and_hand_count():
    config = LLAMA_405B
    job = simulate_job(config, tp=8, pp=16, dp=8, zero_stage=1, precision="bf16")
    h, kv, ffn, vocab = 16384, 8 * 128, 53248, 128256
    layer = (2 * h * h + 2 * h * kv + 3 * h * ffn) // 8 + 2 * h  # q, o, k, v, gate/up/down cut over 8; norms whole
    embed = vocab // 8 * h
    by_stage = {r.coords[0]: r for r in job.ranks}
    assert sorted(by_stage) == [0, 1, 15]  # first (7 layers), a middle one (8 layers), last (7 layers)
    hand = {0: 7 * layer + embed, 1: 8 * layer, 15: 7 * layer + h + embed}
    for stage, rank in by_stage.items():
        n = hand[stage]
        assert rank.numel == n, stage
        expected = {"parameters": 2 * n, "gradients": 2 * n, "gradient buffers (fp32)": 4 * n}
        expected["optimizer (Adam + master)"] = _adam_bytes(n, 8)
        measured = dict(rank.measured)
        # + Adam's step counters: one 4-byte scalar per parameter tensor
        assert 0 <= measured.pop("optimizer (Adam + master)") - expected.pop("optimizer (Adam + master)") < 4096, stage
        assert measured == expected, stage
        assert abs(rank.total - sum(rank.formula.values())) <= 0.01 * rank.total, stage
        assert rank.calls("tp") == rank.minimum["tp"], (stage, rank.collectives)
    assert by_stage[1].total / GIB == pytest.approx(28.21, abs=0.01)  # the table in docs/sizing.md
    # ZeRO-2: each gradient released into its bucket, each bucket freed once reduce-scattered
    zero2 = {r.coords[0]: r for r in simulate_job(config, tp=8, pp=16, dp=8, zero_stage=2, precision="bf16").ranks}
    for stage, rank in zero2.items():
        n = hand[stage]
        assert rank.measured["gradients"] == 0 and rank.measured["gradient buffers (fp32)"] == 4 * n // 8, stage
        assert abs(rank.total - sum(rank.formula.values())) <= 0.01 * rank.total, stage
        assert rank.total < by_stage[stage].total / 2, stage
    assert zero2[1].total / GIB == pytest.approx(11.88, abs=0.01)  # the table in docs/sizing.md


def test_llama3_405b_like_at_zero3_is_built_with_fsdp2_and_read():
    """ZeRO-3: the rank built with FSDP2's fully_shard over the fake group's dp sub-mesh; its sharded
    parameters, gradients and AdamW state read from the DTensors' local shards."""
    job = simulate_job(LLAMA_405B, tp=8, pp=16, dp=8, zero_stage=3, precision="bf16")
    by_stage = {r.coords[0]: r for r in job.ranks}
    assert sorted(by_stage) == [0, 1, 15]
    for stage, rank in by_stage.items():
        measured, shard = rank.measured, rank.numel / 8
        # fp32 dp shards: each parameter's rows cut over 8 (padded per parameter: within 0.1%)
        assert measured["parameters"] == measured["gradients"] == pytest.approx(4 * shard, rel=1e-3), stage
        assert 0 <= measured["optimizer (Adam + master)"] - 2 * measured["parameters"] < 4096, stage  # + step counters
        assert rank.apart <= 0.01, stage
        assert "gathered layers (FSDP2)" in rank.formula_only and rank.total > sum(measured.values())
    assert by_stage[1].total / GIB == pytest.approx(8.91, abs=0.01)  # the table in docs/sizing.md
    assert any("fully_shard" in note for note in job.notes)


def test_mixtral_8x22b_like_moe_bytes_and_one_extra_all_reduce_per_moe_layer():
    config = tf.MixtralConfig(
        hidden_size=6144, num_hidden_layers=56, num_attention_heads=48, num_key_value_heads=8,
        intermediate_size=16384, vocab_size=32768, num_local_experts=8, num_experts_per_tok=2,
    )  # fmt: skip
    job = simulate_job(config, tp=8, pp=8, dp=16, zero_stage=2, precision="bf16")
    h, kv, ffn, experts = 6144, 8 * 128, 16384, 8
    layer = (2 * h * h + 2 * h * kv + experts * 3 * h * ffn) // 8 + experts * h + 2 * h  # + router, norms
    for rank in job.ranks:
        n = rank.numel
        assert n == 7 * layer + (32768 // 8 * h if rank.coords[0] == 0 else 0) + (
            h + 32768 // 8 * h if rank.coords[0] == 7 else 0
        )
        # ZeRO-2 at the end of backward: gradients released, buckets freed, only this rank's reduced row
        assert rank.measured["gradients"] == 0
        assert rank.measured["gradient buffers (fp32)"] == 4 * n // 16
        assert abs(rank.total - sum(rank.formula.values())) <= 0.01 * rank.total
        # the replicated routing weights' partial gradient: one all-reduce more per MoE layer in backward
        assert rank.calls("tp") == rank.minimum["tp"] + len(rank.layers)


def test_deepseek_v3_like_mla_and_moe_simulate(capsys):
    config = tf.DeepseekV3Config(num_hidden_layers=8, first_k_dense_replace=1, n_routed_experts=32)
    job = simulate_job(config, tp=8, pp=4, dp=32, zero_stage=1, precision="bf16")
    assert [r.coords[0] for r in job.ranks] == [0, 1, 3]
    for rank in job.ranks:
        assert abs(rank.total - sum(rank.formula.values())) <= 0.01 * rank.total
        assert rank.measured["parameters"] == 2 * rank.numel
        assert rank.calls("tp") > 0  # MLA's replicated low-rank projections: not the dense minimum's shape
    assert not dist.is_initialized()  # the fake group is gone


def test_cli_simulate_and_its_size_check(capsys):
    assert main(["plan", "llama3-8b", "--tp", "8", "--pp", "2", "--dp", "4", "--simulate"]) == 0
    out = capsys.readouterr().out
    assert "simulated: llama3-8b at tp=8 x pp=2 x dp=4 = 64 ranks" in out and "(0.00% apart)" in out
    assert main(["plan", "llama3-8b", "--tp", "3", "--simulate"]) == 2


def test_expert_parallel_rank_bytes_experts_and_all_to_alls(tmp_path, capsys):
    """ep=4 of dp=8: each rank is built with EngineConfig(ep=4); on meta the routing is taken as even
    (no router choice can be read), so the all-to-alls carry tokens x top-k rows each way."""
    h, ffn, tokens, k = 64, 128, 2 * 8, 2
    config = tf.MixtralConfig(
        hidden_size=h, intermediate_size=ffn, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=8, num_experts_per_tok=k, vocab_size=256, architectures=["MixtralForCausalLM"],
    )  # fmt: skip
    job = simulate_job(config, tp=2, pp=2, dp=8, zero_stage=1, precision="bf16", ep=4, batch=2, seq=8)
    assert [r.coords[0] for r in job.ranks] == [0, 1]
    for rank in job.ranks:
        assert rank.experts == (2, 8, 2)  # 2 of 8 experts in each of the stage's 2 MoE layers
        # 1/ep of the stage's routed experts, each cut over tp: gate_up [E, 2 ffn, h] + down [E, h, ffn]
        assert rank.expert_numel * 4 == 2 * 8 * 3 * h * ffn // 2
        dense = rank.numel - rank.expert_numel
        measured = dict(rank.measured)
        assert measured["parameters"] == measured["gradients"] == 2 * rank.numel
        # fp32 buckets: dense over dp=8, experts over the dp / ep = 2 ranks holding the same ones
        assert measured["gradient buffers (fp32)"] == 4 * 8 * -(-dense // 8) + 4 * rank.expert_numel
        adam = 12 * (-(-dense // 8) + rank.expert_numel // 2)
        assert 0 <= measured.pop("optimizer (Adam + master)") - adam < 4096  # + Adam's step counters
        assert rank.formula["optimizer (Adam + master)"] == adam
        assert measured == {k: v for k, v in rank.formula.items() if k in measured}  # plan's formula at ep
        # per MoE layer: forward the row counts per expert ([ep, 2] int64), the tokens, the outputs back;
        # backward both token exchanges
        calls, nbytes = rank.collectives[("ep", "all_to_all")]
        assert calls == rank.calls("ep") == 5 * 2
        assert nbytes == 2 * (4 * tokens * k * h * 2 + 8 * 8)
        # plan's formula counts what leaves the rank: (ep - 1) / ep of the tokens, over all 4 MoE layers
        assert job.plan.experts.exchange_bytes(tokens, 2) // 2 == 2 * 4 * tokens * k * h * 2 * 3 // 4
        assert rank.calls("expert-dp") > 0 and rank.calls("dp") > 0
    (tmp_path / "mixtral").mkdir()
    config.save_pretrained(tmp_path / "mixtral")
    args = ["plan", str(tmp_path / "mixtral"), "--tp", "2", "--dp", "8", "--ep", "4", "--simulate"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "16 ranks (ep=4 of the dp ranks)" in out and "experts: 2 of 8 per MoE layer (ep=4), in 4 MoE layers" in out
    assert "    ep: 20 all_to_all" in out
