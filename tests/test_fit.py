"""`shardformer plan --gpu-memory` answers whether a job fits, and its numbers are those of the real
per-rank model a simulated job builds; model names in their usual spellings; MoE plans list experts."""

import pytest
import transformers as tf

from shardformer.cli.main import main
from shardformer.expert_parallel.sizing import expert_sizing
from shardformer.models import builds
from shardformer.tools.experts import expert_lines
from shardformer.tools.fit import GIB, parse_memory, plan_stages
from shardformer.tools.model_names import KNOWN, TINY, resolve_name
from shardformer.tools.model_source import PLAN_DERIVED, build_model, resolve_model_name
from shardformer.tools.plan import build_meta_model, plan_model
from shardformer.tools.simulate import simulate_job


def test_llama3_70b_on_8_gpus_of_80gb_at_tp8_gets_a_yes_or_no(capsys):
    args = ["plan", "llama-3-70b", "--tp", "8", "--gpus", "8", "--gpu-memory", "80GB", "--zero", "1"]
    assert main([*args, "--precision", "bf16", "--batch", "1", "--seq", "4096", "--summary"]) == 0
    out = capsys.readouterr().out
    assert "fits on 8 x 80.0 GiB?" in out
    # 70.6B parameters / 8 = 8.8B per rank; bf16 weight + grad, fp32 buffers [dp=1], fp32 master + Adam: 16 B each
    assert "  no checkpointing: no, needs " in out and "  activation checkpointing: no, needs " in out
    # the same model over 64 GPUs (pp 4 x dp 2) fits with checkpointing
    assert main(["plan", "llama3-70b", "--tp", "8", "--pp", "4", "--gpus", "64", "--gpu-memory", "80GiB", "--zero",
                 "1", "--precision", "bf16", "--batch", "1", "--seq", "4096", "--microbatches", "8", "--summary"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "layout: tp=8 x pp=4 x dp=2 = 64 processes" in out
    assert "  activation checkpointing: yes, " in out and "headroom" in out
    assert main(["plan", "llama3-70b", "--tp", "8", "--gpus", "12"]) == 2
    assert "--gpus 12 does not divide into tp x cp x pp = 8" in capsys.readouterr().err


def test_7b_at_pp2_dp4_plan_checks_out_against_the_simulated_ranks():
    """plan's formula for every stage against the ranks a fake process group builds for real: parameters,
    gradients, ZeRO buffers and optimizer state within 0.1%, one micro-batch's activations within 2%."""
    batch, seq = 1, 1024
    job = simulate_job("llama-7b", tp=1, pp=2, dp=4, zero_stage=1, precision="bf16", batch=batch, seq=seq)
    model = build_meta_model("llama-7b")
    plan = plan_model(model, 1, 2, 4, 1, "bf16")
    stages, missing = plan_stages(plan, model.config, batch, seq, microbatches=1)
    assert missing is None and len(job.ranks) == 2
    for rank in job.ranks:
        stage = stages[rank.coords[0]]
        assert stage.numel == rank.numel and tuple(stage.layers) == rank.layers
        for part in ("parameters", "gradients", "gradient buffers (fp32)", "optimizer (Adam + master)"):
            assert rank.measured[part] == pytest.approx(stage.state[part], rel=1e-3), part
        assert rank.activations == pytest.approx(stage.activations["no checkpointing"], rel=0.02)
    assert sum(stages[0].state.values()) / GIB == pytest.approx(34.52, abs=0.01)  # the docs' number (sizing.md)


def test_memory_sizes_and_microbatches_in_flight(capsys):
    assert parse_memory("80GB") == parse_memory("80GiB") == parse_memory("80") == 80 * GIB
    assert parse_memory("81920MiB") == 80 * GIB and parse_memory("1.5t") == int(1.5 * 2**40)
    with pytest.raises(ValueError, match="not a memory size"):
        parse_memory("lots")
    model = build_meta_model("gpt2")
    plan = plan_model(model, 1, 2, 1, 0, "fp32")
    one, _ = plan_stages(plan, model.config, 2, 128, microbatches=1)
    four, _ = plan_stages(plan, model.config, 2, 128, microbatches=4)
    gpipe, _ = plan_stages(plan, model.config, 2, 128, microbatches=4, schedule="gpipe")
    assert [s.in_flight for s in four] == [2, 1] and [s.in_flight for s in gpipe] == [4, 4]
    # 1F1B: stage 0 keeps 2 micro-batches' layer activations, the last stage 1
    assert four[0].activations["no checkpointing"] == 2 * one[0].activations["no checkpointing"]
    assert four[1].activations["no checkpointing"] == one[1].activations["no checkpointing"]
    assert main(["plan", "gpt2", "--gpu-memory", "8GB", "--summary"]) == 0
    out = capsys.readouterr().out
    assert "model state and buffers only: yes" in out and "give --batch and --seq" in out
    # no activation estimate for the family (BERT) or no transformers config (timm): said, model state judged
    assert main(["plan", "bert-base", "--gpu-memory", "24GB", "--batch", "8", "--seq", "512", "--summary"]) == 0
    out = capsys.readouterr().out
    assert "model state and buffers only: yes" in out and "no activation estimate for model_type='bert'" in out
    assert main(["plan", "timm:vit_base_patch16_224", "--gpu-memory", "24GB", "--batch", "8", "--seq", "197"]) == 0
    assert "no activation estimate for a model without a transformers config" in capsys.readouterr().out


@pytest.mark.parametrize(
    "spelling, name",
    [
        ("llama-70b", "llama3-70b"),
        ("llama3-70b", "llama3-70b"),
        ("llama-3-70b", "llama3-70b"),
        ("meta-llama/Llama-3.1-70B", "llama3-70b"),
        ("meta-llama/Meta-Llama-3-70B-Instruct", "llama3-70b"),
        ("Llama-3.1-405B", "llama3-405b"),
        ("llama2-7b", "llama-7b"),
        ("mistralai/Mixtral-8x7B-v0.1", "mixtral-8x7b"),
        ("deepseek-ai/DeepSeek-V3", "deepseek-v3"),
        ("microsoft/Phi-3-mini-4k-instruct", "phi3-mini"),
        ("openai-community/gpt2", "gpt2"),
        ("google-bert/bert-base-uncased", "bert-base"),
    ],
)
def test_model_name_spellings(spelling, name):
    assert resolve_name(spelling, {**builds(), **PLAN_DERIVED}) == name


def test_known_names_are_the_builds_unknown_names_get_close_matches(tmp_path, capsys):
    assert set(KNOWN) | set(TINY) == set(builds()) | set(PLAN_DERIVED)  # the --help list cannot drift
    with pytest.raises(ValueError, match=r"did you mean llama3-70b.*known names: .*llama3-405b"):
        resolve_model_name("lama3-70b", {**builds(), **PLAN_DERIVED})
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "llama3-70b" in capsys.readouterr().out
    # a hub-style folder (org/name with config.json) is read as a folder
    folder = tmp_path / "meta-llama" / "Llama-tiny"
    tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                   architectures=["LlamaForCausalLM"]).save_pretrained(folder)  # fmt: skip
    assert type(build_model(str(folder), weights=False)).__name__ == "LlamaForCausalLM"


def test_a_hub_id_downloaded_before_is_read_from_the_local_cache(tmp_path, monkeypatch):
    import huggingface_hub

    snapshot = tmp_path / "models--some-org--Llama-tiny" / "snapshots" / "abc123"
    tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                   architectures=["LlamaForCausalLM"]).save_pretrained(snapshot)  # fmt: skip
    (tmp_path / "models--some-org--Llama-tiny" / "refs").mkdir()
    (tmp_path / "models--some-org--Llama-tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert build_model("some-org/Llama-tiny", weights=False).config.num_hidden_layers == 3
    with pytest.raises(ValueError, match="is not a folder with config.json"):
        build_model("some-org/not-downloaded", weights=False)  # nothing is fetched


def test_moe_plan_lists_the_experts(capsys):
    config = tf.MixtralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=100,
    )  # fmt: skip
    plan = plan_model(build_meta_model(lambda: tf.MixtralForCausalLM(config)), tp=2)
    lines = expert_lines(plan.params, plan.experts, tp=2)
    # per layer: gate_up [4, 256, 64] + down [4, 64, 128] = 98,304 expert parameters; 2 layers
    assert lines[0] == "experts: 4 routed per MoE layer (top-2), in 2 layers"
    assert f"routed experts' parameters: {2 * 98304:,} of {plan.full_numel:,} unsharded" in lines[1]
    assert f"{98304:,} of {plan.rank_numel:,} per rank" in lines[1]
    assert (
        lines[-1] == "  per rank: 4 experts of each MoE layer, each cut over tp=2 (expert-internal tensor parallelism)"
    )
    at_ep2 = expert_sizing(build_meta_model(lambda: tf.MixtralForCausalLM(config)), ep=2)  # ep plugs in here
    assert expert_lines(plan.params, at_ep2, tp=2)[-1].startswith("  per rank: 2 experts of each MoE layer (1/2")
    assert plan_model(build_meta_model("gpt2")).experts is None
    assert main(["plan", "mixtral-8x7b", "--tp", "8", "--summary"]) == 0
    assert "experts: 8 routed per MoE layer (top-2), in 32 layers" in capsys.readouterr().out


def test_plan_at_an_expert_parallel_size(capsys):
    """--ep: each rank holds 1/ep of the routed experts (its parameters and gradients), ZeRO steps them
    over dp / ep ranks, and the exchange's bytes are counted; sizes that do not fit are refused."""
    config = tf.MixtralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=100,
    )  # fmt: skip
    build = lambda: build_meta_model(lambda: tf.MixtralForCausalLM(config))  # noqa: E731
    whole = plan_model(build(), tp=2, dp=4, zero=1, precision="bf16")
    split = plan_model(build(), tp=2, dp=4, zero=1, precision="bf16", ep=2, batch=1, seq=64)
    assert split.routed_numel * 2 == whole.routed_numel == 98304  # 2 layers x 4 experts cut over tp, 1/ep of them
    assert split.rank_numel == whole.rank_numel - whole.routed_numel // 2
    dense = whole.rank_numel - whole.routed_numel
    # Adam + fp32 master (12 bytes) of the dense part over dp=4, of this rank's experts over dp / ep = 2
    assert split.bytes_per_rank()["optimizer (Adam + master)"] == 12 * (-(-dense // 4) + split.routed_numel // 2)
    lines = expert_lines(split.params, split.experts, 2, split.tokens, 2)
    assert lines[-2].startswith("  per rank: 2 experts of each MoE layer (1/2 of them: ep=2)")
    # 64 tokens x top-2 x 64 wide x 2 bytes, half of it leaving the rank, 4 exchanges, 2 layers
    assert lines[-1].startswith(
        f"  all-to-all: {64 * 2 * 64 * 2 // 2 * 4 / 2**20:,.1f} MiB sent per rank per MoE layer"
    )
    assert main(["plan", "mixtral-8x7b", "--tp", "2", "--dp", "4", "--ep", "4", "--summary"]) == 0
    assert "2 experts of each MoE layer (1/4 of them: ep=4)" in capsys.readouterr().out
    assert main(["plan", "mixtral-8x7b", "--dp", "4", "--ep", "3"]) == 2
    assert "expert_parallel_size=3 does not divide data_parallel_size=4" in capsys.readouterr().err
    assert main(["plan", "gpt2", "--dp", "2", "--ep", "2"]) == 2
    assert "cannot be split by experts" in capsys.readouterr().err
