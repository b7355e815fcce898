"""`shardformer verify`, and the ranks agreeing on tokens and RNG (issue 14, traps 1-6, 8).

All multi-rank checks share one spawn of 2 gloo ranks; each asserts on every rank.
"""

import torch
import torch.distributed as dist
import transformers as tf

import shardformer
from examples.custom_policy.llama_policy import LlamaPolicy
from shardformer import ShardConfig, shard_model
from shardformer.cli.main import main
from shardformer.tools.model_source import TINY_MODELS
from shardformer.tools.verify import verify_on_this_rank
from tests.helpers import check_table
from tests.policies.custom_policies import (
    BrokenGPT2Policy,
    LlamaWithModelsOwnLossPolicy,
    OPTPolicy,
    tiny_llama,
    tiny_opt,
)


def same_on_every_rank(t: torch.Tensor) -> bool:
    pieces = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, t.contiguous())
    return all(torch.equal(p, pieces[0]) for p in pieces)


def check_verify_passes_on_every_builtin_policy():
    for name in TINY_MODELS:  # GPT-2, BERT, ViT, timm ViT
        report = verify_on_this_rank(name)
        assert report.ok, report.format()
        assert len(report.checks) >= 5, report.format()


def check_verify_names_the_first_diverging_module():
    report = verify_on_this_rank("gpt2-tiny", BrokenGPT2Policy())
    assert not report.ok
    # c_attn's own output gathers back equal; the attention that splits it into Q, K, V does not
    assert report.divergence.module == "transformer.h.0.attn", report.format()
    assert report.divergence.cls == "GPT2Attention" and report.divergence.error > 1e-3
    # a wrong cut differs as much in float64: the rerun does not excuse it
    assert report.checks[-1].name == "float64 rerun", report.format()
    rerun = report.checks[-1].detail
    assert rerun.startswith("not excused: in float64 ") and "gradients: first mismatch" in rerun, report.format()


def tiny_cpmant():
    """CPM-Ant's tiny copy: exact at tp=2, but its outputs after one SGD step differ by ~7e-4 in float32
    (rounding of the two ranks' partial sums, amplified by the model) — 6e-12 in float64."""
    from sweeps.zoo import build_tiny

    return build_tiny("CpmAntForCausalLM", None)


def check_float32_rounding_is_told_apart_from_a_wrong_cut():
    report = verify_on_this_rank(tiny_cpmant)
    assert report.ok, report.format()
    after = next(c for c in report.checks if c.name == "outputs after step")
    assert "in float32" in after.detail and "rounding, not the cut" in after.detail, report.format()
    assert report.checks[-1].name == "float64 rerun", report.format()


def check_custom_opt_policy_without_attrs_or_bindings_is_exact():  # traps 1 and 5
    report = verify_on_this_rank(tiny_opt, OPTPolicy())
    assert report.ok, report.format()


def check_custom_vocab_parallel_head_with_injected_loss_is_exact_and_generates():  # traps 2 and 8
    report = verify_on_this_rank(tiny_llama, LlamaPolicy())
    assert report.ok, report.format()
    assert [c.name for c in report.checks][-1] == "greedy generate"
    model = shard_model(tiny_llama(), ShardConfig(tensor_parallel_size=2), LlamaPolicy())
    assert not model.lm_head.gather_output  # the logits really are vocab-parallel outside generate
    # without the injected loss, transformers' own causal-LM loss is replaced by the vocab-parallel one
    report = verify_on_this_rank(tiny_llama, LlamaWithModelsOwnLossPolicy())
    assert report.ok, report.format()


def check_sampled_tokens_agree_on_every_rank():  # trap 3
    torch.manual_seed(dist.get_rank())  # different seeds per rank, as a careless script has
    model = shard_model(tiny_llama(), ShardConfig(tensor_parallel_size=2), UncheckedVocabParallel()).eval()
    assert same_on_every_rank(torch.rand(4))  # sharding made the tp ranks' RNG agree
    torch.manual_seed(100 + dist.get_rank())  # and even if they drift apart again afterwards
    prompt = torch.tensor([[5, 17, 42], [7, 8, 9]])
    tokens = model.generate(prompt, do_sample=True, top_k=20, max_new_tokens=12, pad_token_id=0, eos_token_id=3)
    assert same_on_every_rank(tokens)
    shardformer.seed(7)  # explicit seeding: the same state on every rank
    assert same_on_every_rank(torch.rand(4))


def check_functional_dropout_agrees_on_every_rank():  # trap 4: OPT calls F.dropout in its forward
    torch.manual_seed(dist.get_rank())
    model = shard_model(tiny_opt(dropout=0.5), ShardConfig(tensor_parallel_size=2), OPTPolicy()).train()
    ids = torch.randint(3, 99, (2, 8), generator=torch.Generator().manual_seed(1))
    hidden = model.model.decoder(ids).last_hidden_state
    assert same_on_every_rank(hidden.detach())
    assert same_on_every_rank(model(ids).logits.detach())


def check_verify_with_pipeline_stages():  # tp=1 x pp=2 on the same two ranks
    from shardformer.tools.verify_pipeline import verify_pipeline_on_this_rank
    from shardformer.tools.verify_report import merge_reports
    from tests.pipeline.test_spec_check import TIED_NOT_SHARED

    reports = [None, None]
    dist.all_gather_object(reports, verify_pipeline_on_this_rank("gpt2-tiny", pp=2))
    report = merge_reports(reports)
    names = ["loss", "outputs after step", "weights of stage 0", "weights of stage 1"]  # every stage named
    assert report.ok and [c.name for c in report.checks] == names, report.format()
    report = verify_pipeline_on_this_rank("gpt2-tiny", pp=2, pipeline=TIED_NOT_SHARED)  # trap 6: refused, nothing waits
    assert report.error.startswith("sharding refused: transformer.wte.weight (first), lm_head.weight (last)")


class UncheckedVocabParallel(LlamaPolicy):
    binding_policy = lambda self: None  # noqa: E731


test_tp2 = check_table(
    [
        check_verify_passes_on_every_builtin_policy,
        check_verify_names_the_first_diverging_module,
        check_float32_rounding_is_told_apart_from_a_wrong_cut,
        check_custom_opt_policy_without_attrs_or_bindings_is_exact,
        check_custom_vocab_parallel_head_with_injected_loss_is_exact_and_generates,
        check_sampled_tokens_agree_on_every_rank,
        check_functional_dropout_agrees_on_every_rank,
        check_verify_with_pipeline_stages,
    ],
    2,
)


def test_cli_verify_refuses_a_bad_model_in_one_line_before_starting_processes(tmp_path, capsys, monkeypatch):
    import shardformer.tools.verify as verify_module

    def no_processes(*args, **kwargs):
        raise AssertionError("processes were started")

    monkeypatch.setattr(verify_module, "run_on_ranks", no_processes)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "gpt2", ')
    bare = tmp_path / "bare"
    tf.GPT2Config(n_layer=1).save_pretrained(bare)
    cases = [
        ([str(tmp_path / "missing")], "is not a folder with config.json, module:function"),
        ([str(bad)], "config.json is not valid JSON (Expecting"),
        ([str(bare)], "has no 'architectures'; name the model class with --model-class (e.g. GPT2LMHeadModel)"),
        (
            [str(bare), "--model-class", "GPT2ForCausalLM"],
            "'GPT2ForCausalLM' (from --model-class) is not a transformers",
        ),
        (["no_such_module:build"], "cannot import it"),
    ]
    for argv, message in cases:
        assert main(["verify", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("shardformer verify: error: ") and message in err and err.count("\n") == 1, err
    # plan reads the same way, and its hint names a class that exists
    assert main(["plan", str(bare)]) == 2
    assert "(e.g. GPT2LMHeadModel)" in capsys.readouterr().err
    assert main(["plan", str(bad)]) == 2
    assert "config.json is not valid JSON" in capsys.readouterr().err


def test_cli_verify_fails_on_a_broken_policy_naming_the_module(capsys):
    status = main(["verify", "gpt2-tiny", "--policy", "tests.policies.custom_policies:BrokenGPT2Policy"])
    out = capsys.readouterr().out
    assert status == 1, out
    assert "first diverging module: transformer.h.0.attn (GPT2Attention)" in out
    assert "FAILED" in out


def test_rounding_is_excused_only_where_float64_or_the_models_own_rounding_explains_it():
    """`excuse_rounding` on made-up reports: failures that shrink 10^4-fold in float64 pass; the outputs after
    the step pass within the unsharded model's own float32-vs-float64 gap; a gradient that differs as much in
    float64, or an output past the model's own rounding, stays failed."""
    from shardformer.tools.verify_report import Check, VerifyReport, excuse_rounding

    def report(*checks, after=None):
        return VerifyReport("M", "P", 2, [Check(*c) for c in checks], reference_after_step=after)

    shrinks = report(("gradients", False, "3e-4", 3e-4))
    excuse_rounding(shrinks, report(("gradients", True, "1e-12", 1e-12)))
    assert shrinks.ok and "rounding, not the cut" in shrinks.checks[0].detail

    stays = report(("gradients", False, "3e-4", 3e-4))
    excuse_rounding(stays, report(("gradients", True, "2e-5", 2e-5)))  # passes at fp32 tolerance, not 10^4 smaller
    assert not stays.ok and stays.checks[-1].detail.startswith("not excused")

    ref32, ref64 = torch.zeros(3), torch.tensor([0.0, 6e-4, 0.0], dtype=torch.float64)
    within = report(("outputs after step", False, "5e-4", 5e-4), after=ref32)
    excuse_rounding(within, report(("outputs after step", True, "1e-5", 1e-5), after=ref64))
    assert within.ok and "own float32 rounding" in within.checks[0].detail

    past = report(("outputs after step", False, "9e-4", 9e-4), after=ref32)
    excuse_rounding(past, report(("outputs after step", True, "1e-5", 1e-5), after=ref64))
    assert not past.ok


def test_outputs_after_a_step_that_overflows_the_unsharded_model_compare_where_finite():
    """A step at verify's LR can overflow the unsharded model's own outputs (a batch-normed ResNet's): the
    sharded ones must be non-finite at the same places and agree elsewhere."""
    from shardformer.tools.verify import _outputs_after_step

    ref = torch.tensor([1.0, float("nan"), 3.0, float("inf")])
    assert _outputs_after_step(ref.clone(), ref).ok
    assert not _outputs_after_step(torch.tensor([1.0, 2.0, 3.0, float("inf")]), ref).ok  # finite where it is not
    assert not _outputs_after_step(torch.tensor([1.5, float("nan"), 3.0, float("inf")]), ref).ok  # differs
    check = _outputs_after_step(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
    assert not check.ok and check.detail == "max |diff| 0.5"


def test_the_main_output_of_a_backbone_is_its_first_feature_map():
    """A backbone returns ``feature_maps``, a tuple (HGNetV2's): its first map is the output compared."""
    from transformers.modeling_outputs import BackboneOutput

    from shardformer.core.divergence import first_tensor

    maps = (torch.ones(1, 2, 3, 3), torch.zeros(1, 4, 2, 2))
    assert first_tensor(BackboneOutput(feature_maps=maps)) is maps[0]
    assert first_tensor((None, [None, maps[1]])) is maps[1]


def test_the_float64_rerun_raises_the_float32_a_model_asks_for():
    """A norm that computes in float32 whatever its input (transformers' RMSNorms cast to float32) rounds a
    float64 copy to float32 precision; inside `Float64Everywhere` it computes in float64 throughout, so the
    rerun can tell a cut's rounding from a wrong cut (MuseSpark's router and norms: 4e-4 in float32, 1.8e-6
    in a plain float64 rerun, 1.4e-12 in this mode)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from shardformer.core.float64_mode import Float64Everywhere

    torch.manual_seed(0)
    norm = LlamaRMSNorm(64, eps=1e-6).double()
    x = torch.randn(4, 64, dtype=torch.float64) * 3
    exact = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert (norm(x) - exact).abs().max() > 1e-9  # a float32 step inside
    with Float64Everywhere():
        assert (norm(x) - exact).abs().max() < 1e-14
        assert torch.softmax(x, -1, dtype=torch.float32).dtype == torch.float64
        assert torch.arange(3).float().dtype == x.to(torch.float32).dtype == torch.float64
    assert x.float().dtype == torch.float32  # only inside the mode


def test_generate_gets_the_inputs_a_models_own_generate_requires():
    """BLIP's captioner's ``generate(pixel_values, ...)`` is found past the ``generate(*args, **kwargs)`` a
    sharded model's class wraps it in."""
    from shardformer.tools.verify import _required_by_generate

    class Captioner:
        def generate(self, pixel_values, input_ids=None, **kwargs):
            return pixel_values

    class Sharded(Captioner):
        def generate(self, *args, **kwargs):
            return super().generate(*args, **kwargs)

    assert _required_by_generate(Sharded()) == ["pixel_values"]
    assert _required_by_generate(object.__new__(type("Plain", (), {"generate": lambda self, **kw: 0}))) == []
