"""sweeps/rows.py, the sweeps' one row runner: every row comes back with a result, a row past its budget is
killed from outside (even one stuck in a C call that holds the GIL) and the sweep goes on after it."""

import os
import re
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sweeps.rows import ERROR, NOT_TESTED, PASSED, NotTested, run_rows  # noqa: E402


def _check(row: dict) -> None:
    """On the rank: what each row's ``does`` asks for."""
    if row["does"] == "pass":
        row.update(result=PASSED, reason="")
    elif row["does"] == "raise":
        raise ValueError("a bug in the check")
    elif row["does"] == "not tested":
        raise NotTested("no tiny copy runs")
    elif row["does"] == "grow":
        held = b"x" * (2 << 30)  # written, so resident: past the 1.5 GiB budget below
        time.sleep(60)  # far past the time budget: only the memory budget can stop this row in time
        del held
    elif row["does"] == "hang":
        re.match(r"(a+)+$", "a" * 60 + "b")  # years of backtracking in C, the GIL held: no timer thread runs


@pytest.mark.harness  # 30 s of budgets: run by `make examples` (CI), not `make test`
def test_each_row_gets_its_result_and_a_row_past_its_budget_is_killed():
    """Past the time budget (a hang), or past the memory budget (a rank that grows): killed, named, and the
    sweep goes on in a fresh spawn (the machine's memory back)."""
    rows = [
        {"name": "skipped", "skip": "class not importable"},
        {"name": "a", "does": "pass"},
        {"name": "b", "does": "raise"},
        {"name": "c", "does": "not tested"},
        {"name": "m", "does": "grow"},  # stopped by the memory budget long before its time budget
        {"name": "d", "does": "hang"},  # in a fresh spawn, after the grown row's ranks were killed
    ]
    seen = []
    # 10 s: writing 2 GiB on a loaded machine took over 6 s once, and the memory row became a time row
    got = {r["name"]: r for r in run_rows(rows, _check, world=1, budget=10.0, memory_gib=1.5, progress=seen.append)}
    assert [r["name"] for r in seen] == ["skipped", "a", "b", "c", "m", "d"]
    assert (got["skipped"]["result"], got["skipped"]["reason"]) == (NOT_TESTED, "class not importable")
    assert got["a"]["result"] == PASSED
    assert got["b"]["result"] == ERROR and "ValueError: a bug in the check" in got["b"]["reason"]
    assert (got["c"]["result"], got["c"]["reason"]) == (NOT_TESTED, "no tiny copy runs")
    assert got["d"]["result"] == ERROR and "row budget of 10 s" in got["d"]["reason"], got["d"]
    assert got["d"]["seconds"] == 10.0
    grown = got["m"]
    assert grown["result"] == ERROR and "memory budget of 1.5 GiB" in grown["reason"], grown
    assert grown["seconds"] < 10.0
    assert all(isinstance(r["seconds"], float) for r in got.values() if r["name"] != "skipped")


def test_upstream_failures_are_named():
    """A not-tested row says when the class itself fails, before any tiny copy: its default config, with what
    it leaves unset filled (LFM2-MoE's schedule), builds no model, or it needs a library that is not
    installed (LayoutLMv2's detectron2). DBRX's
    default builds none either (its attention reads attn_config.rope_theta, which the sub-config does not
    declare): the values its checkpoints set, dotted keys into the sub-config, make it build. Built on the
    meta device: no memory, no forward."""
    from sweeps.zoo import check_unsharded, default_build_failure

    assert default_build_failure("Lfm2MoeForCausalLM") is None  # unfilled: "'NoneType' is not subscriptable"
    assert default_build_failure("LlamaForCausalLM") is None
    assert default_build_failure("DbrxForCausalLM") is None
    # Qwen 4 Exp's indexer fields (None by default) and Gemma 4 Assistant's text config (its default refused by
    # its own validator, so given at construction) set as the validators require
    for name in ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration", "Gemma4AssistantForCausalLM"):
        assert default_build_failure(name) is None, name
    row = {"class": "LayoutLMv2ForSequenceClassification"}
    check_unsharded(row)
    assert row["result"] == NOT_TESTED and row["reason"].startswith("upstream: ") and "detectron2" in row["reason"]


def test_upstream_forward_failures_are_named():
    """A class whose own code fails on the tiny copy's inputs is marked upstream with the reason: xLSTM's
    cache rounds its key width up to a multiple of 64 and its layers do not (the tiny copy, in eval mode);
    BLT's cache reads a num_hidden_layers its config lacks (its default config, on the meta device); Llama 4's
    image-text forward reads an output its language model does not give."""
    import torch
    import transformers as tf

    from shardformer.core.tiny import tiny_copy_config
    from sweeps.zoo import upstream_failure

    xlstm = tf.xLSTMForCausalLM(tiny_copy_config(tf.xLSTMConfig())).eval()
    with pytest.raises(ValueError, match="matC_old has wrong shape") as caught:
        xlstm(input_ids=torch.ones(1, 4, dtype=torch.long))
    assert xlstm.config.qk_dim != xlstm.config.hidden_size * xlstm.config.qk_dim_factor
    assert "multiple of 64" in upstream_failure("xLSTMForCausalLM", str(caught.value))
    with torch.device("meta"):
        blt = tf.BltForCausalLM(tf.BltConfig()).eval()
        with pytest.raises(AttributeError, match="num_hidden_layers") as caught:
            blt(input_ids=torch.ones(1, 4, dtype=torch.long))
    assert "BltConfig" in upstream_failure("BltForCausalLM", str(caught.value))
    llama4 = tf.Llama4ForConditionalGeneration(tiny_copy_config(tf.Llama4Config())).eval()
    with pytest.raises(AttributeError, match="image_outputs") as caught:  # on any input: text alone here
        llama4(input_ids=torch.ones(1, 4, dtype=torch.long))
    assert "language model" in upstream_failure("Llama4ForConditionalGeneration", str(caught.value))
    vision = tf.Llama4VisionConfig()  # its default tower: an adapter sized for the checkpoints' 1408, not 768
    assert vision.intermediate_size == 1408 / vision.pixel_shuffle_ratio**2 != vision.hidden_size * 4
    assert upstream_failure("LlamaForCausalLM", "any error") is None
    # Reformer's backward refuses eval mode: checked in training mode (tests/test_tiny.py), not an upstream failure
    assert upstream_failure("ReformerForMaskedLM", "use `model.train()` to put the model") is None


def test_batch_norms_of_a_shrinking_tiny_copy_are_settled():
    """ALIGN's tiny random EfficientNet, in eval mode, shrinks its features to ~1e-29 (its norms' scales are
    drawn around 0, its fresh statistics fit no layer) and normalises them to 0/0; EfficientNet's own copy
    ends at exactly zero: nothing to prove a cut against. Settled as training leaves them
    (`shardformer.core.tiny_norms`), both compute. MobileNetV2's 32-pixel copy ends in 1x1 maps (a norm over
    two values in training mode: a zero input gradient, rounding compared); its copy takes 64 pixels."""
    import torch
    import transformers as tf

    from shardformer.core.inputs import make_inputs
    from shardformer.core.tiny import tiny_copy_config
    from shardformer.core.tiny_norms import settle_batch_norms
    from shardformer.core.tiny_run import runnable_tiny_config

    torch.manual_seed(0)
    align = tf.AlignModel(tiny_copy_config(tf.AlignConfig())).eval()
    torch.manual_seed(0)
    efficientnet = tf.EfficientNetModel(tiny_copy_config(tf.EfficientNetConfig())).eval()
    x, y = make_inputs(align, seed=0), make_inputs(efficientnet, seed=0)
    with torch.no_grad():
        assert torch.isnan(align(**x).logits_per_image).all()
        assert not efficientnet(**y).pooler_output.abs().max() > 0
        settle_batch_norms(align, x), settle_batch_norms(efficientnet, y)
        assert torch.isfinite(align(**x).logits_per_image).all()
        assert efficientnet(**y).pooler_output.abs().max() > 1e-2
    assert runnable_tiny_config(tf.MobileNetV2Model, tf.MobileNetV2Config(), 2).image_size == 64


def test_generate_gets_what_the_class_needs():
    """MusicGen's generate starts each codebook's delay pattern from the decoder start token its checkpoints
    set (bos), and Pop2Piano's reads a composer map from the generation config its checkpoints ship
    (`sweeps.zoo.GENERATION_AS_CHECKPOINTS`), then generates from ``input_features`` alone: verify's greedy
    generate runs on both tiny copies."""
    import torch
    import transformers as tf

    from shardformer.core.inputs import make_inputs
    from shardformer.core.tiny import tiny_copy_config
    from shardformer.tools.verify import NEW_TOKENS, _generate
    from sweeps.zoo import GENERATION_AS_CHECKPOINTS

    for name in ("MusicgenForCausalLM", "Pop2PianoForConditionalGeneration"):
        torch.manual_seed(0)
        model = getattr(tf, name)(tiny_copy_config(getattr(tf, name).config_class())).eval()
        for key, value in GENERATION_AS_CHECKPOINTS.get(name, lambda _: {})(model.config).items():
            setattr(model.generation_config, key, value)
        assert _generate(model, make_inputs(model, seed=0)).shape[-1] >= NEW_TOKENS


def test_drafters_and_missing_generation_backends_are_named_upstream():
    """Gemma 4's assistants (unified, and the plain one) refuse any forward without their target model's shared
    keys and values (drafters, run inside the target's generate); VibeVoice's generate builds its noise scheduler from
    diffusers, not installed here. Meta-device build; the scheduler's own builder, no model."""
    import torch
    import transformers as tf
    from transformers.models.vibevoice.generation_vibevoice import VibeVoiceGenerationMixin

    from shardformer.core.tiny import tiny_copy_config
    from sweeps.zoo import AS_CHECKPOINTS_SET, _nested, upstream_failure

    with torch.device("meta"):
        assistant = tf.Gemma4UnifiedAssistantForCausalLM(tiny_copy_config(tf.Gemma4UnifiedAssistantConfig()))
        with pytest.raises(ValueError, match="shared_kv_states cannot be None") as caught:
            assistant(input_ids=torch.ones(1, 4, dtype=torch.long))
    assert "drafter" in upstream_failure("Gemma4UnifiedAssistantForCausalLM", str(caught.value))
    with torch.device("meta"):
        config = tf.Gemma4AssistantConfig(**_nested(AS_CHECKPOINTS_SET["Gemma4AssistantForCausalLM"]))
        assistant = tf.Gemma4AssistantForCausalLM(tiny_copy_config(config))
        with pytest.raises(ValueError, match="shared_kv_states cannot be None") as caught:
            assistant(input_ids=torch.ones(1, 4, dtype=torch.long))
    assert "drafter" in upstream_failure("Gemma4AssistantForCausalLM", str(caught.value))
    try:
        import diffusers  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="requires `diffusers`") as caught:
            VibeVoiceGenerationMixin._build_default_noise_scheduler(tf.GenerationConfig())
        assert "diffusers" in upstream_failure("VibeVoiceForConditionalGeneration", str(caught.value))
