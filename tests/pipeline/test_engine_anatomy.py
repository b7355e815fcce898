"""Models split from their anatomy (no hand-written pipeline spec, no pp plan) through ParallelEngine on
4 gloo ranks, pp=2 x tp=2 with ZeRO, against one process training the unsharded model on the same
batches: the loss of every step and every weight after the steps (AdamW, and SGD where the step is
proportional to the gradient). A derived-route decoder (BLOOM, at ZeRO-3), built-in families' heads that
have no spec of their own (BERT, GPT-2 classifiers), a vision-language model (LLaVA, its tower on stage 0).
Sequence parallelism on the derived route (GPT-Neo) at tp=2, and encoder-decoders: Whisper and T5 split at
their boundary, BART in four chunks. timm models with no family record (their tokens
held by the model itself, Swin split between its stages; the export reloaded by timm) and a
hand-written plain-module LM. One spawn.
"""

import copy

import pytest
import torch
import transformers as tf

from shardformer.core.tiny import tiny_config
from shardformer.models import inputs_for
from shardformer.pipeline.spec_check import PipelineSpecError, check_pipeline_spec
from shardformer.policies.anatomy import final_norm, layer_stack
from shardformer.policies.anatomy_pipeline import AnatomyStageForward, pipeline_spec_for
from shardformer.policies.encoder_decoder import EncoderDecoderStageForward
from shardformer.tools.pair_check import load_pair
from tests.helpers import check_table
from tests.pipeline import common
from tests.pipeline.test_engine import STEPS, _check
from tests.policies.derived_models import runnable_model


def _classifier_batches(steps, labels=3, seed=0):
    """Right-padded batches (pad token 0) with sequence labels: heads that pool find the last real token."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(3, 99, (common.BATCH, 8), generator=g)
        lengths = torch.randint(3, 9, (common.BATCH,), generator=g)
        mask = (torch.arange(8) < lengths[:, None]).long()
        out.append(
            {
                "input_ids": ids * mask,
                "attention_mask": mask,
                "labels": torch.randint(0, labels, (common.BATCH,), generator=g),
            }
        )
    return out


def _run(name, combo, zero_stage=1, data=None, optimizer=common.adamw, engine_options=None, **config):
    cls = getattr(tf, name)
    pair = load_pair(cls, tiny_config(cls.config_class, **{"num_hidden_layers": common.LAYERS, **config}))
    stage = pipeline_spec_for(pair[1]).stage_forward  # neither a family's spec nor a pp plan's
    assert isinstance(stage, (AnatomyStageForward, EncoderDecoderStageForward))
    data = data or common.batches(name, STEPS)
    return _check(
        name, *combo, zero_stage=zero_stage, model_pair=pair, data=data, optimizer=optimizer, **(engine_options or {})
    )


def check_bloom_causal_lm_tp2_pp2_zero3_sgd():  # the stage forward inside FSDP2's root call
    _run(
        "BloomForCausalLM",
        (2, 2, 1, "1f1b", 2, 0.5, "torch"),
        zero_stage=3,
        optimizer=common.sgd,
        n_layer=common.LAYERS,
    )


def check_bert_sequence_classification_tp2_pp2_zero2_sgd():
    _run(
        "BertForSequenceClassification", (2, 2, 1, "1f1b", 2, None, "torch"), zero_stage=2, optimizer=common.sgd,
        data=_classifier_batches(STEPS, seed=1), num_labels=3,
    )  # fmt: skip


def check_gpt2_sequence_classification_tp2_pp2_zero1():  # pools the last token that is not padding
    _run(
        "GPT2ForSequenceClassification",
        (2, 2, 1, "gpipe", 2, 0.5, "torch"),
        data=_classifier_batches(STEPS, seed=2),
        num_labels=3,
        pad_token_id=0,
        n_layer=common.LAYERS,
    )


def check_sequence_parallel_gpt_neo_tp2_pp2_zero1_sgd():  # a derived decoder: its layer stack from the structure
    engine = _run(
        "GPTNeoForCausalLM", (2, 2, 1, "1f1b", 2, 0.5, "torch"), optimizer=common.sgd,
        engine_options={"sequence_parallel": True}, num_layers=common.LAYERS,
        attention_types=[[["global", "local"], common.LAYERS // 2]], window_size=4,
    )  # fmt: skip
    assert engine.model.shardformer.sequence_parallel is not None
    assert engine.model.shardformer.route == "derived"


def check_bart_tp2_pp2_interleaved_zero1():  # chunks of one layer: the encoder's output carried past the decoder's
    _run(
        "BartForConditionalGeneration", (2, 2, 1, "interleaved_1f1b", 2, 0.5, "torch"), num_hidden_layers=2,
        decoder_layers=2, data=common.batches("Bart", 2),
    )  # fmt: skip


def check_t5_tp2_pp2_zero2_sgd():  # each stack's first layer computes the position bias on its own stage
    _run(
        "T5ForConditionalGeneration", (2, 2, 1, "gpipe", 2, None, "p2p"), zero_stage=2, optimizer=common.sgd,
        num_hidden_layers=2, num_decoder_layers=2, decoder_start_token_id=0,
    )  # fmt: skip


def check_whisper_tp2_pp2_zero1_sgd():  # speech: the encoder's stage takes log-mel frames, not token ids
    g = torch.Generator().manual_seed(0)
    data = [
        {
            "input_features": torch.randn(common.BATCH, 8, 32, generator=g),
            "labels": torch.randint(3, 99, (common.BATCH, 6), generator=g),
        }
        for _ in range(STEPS)
    ]
    _run(
        "WhisperForConditionalGeneration", (2, 2, 1, "1f1b", 2, 0.5, "torch"), data=data, optimizer=common.sgd,
        num_hidden_layers=2, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        num_mel_bins=8,
        max_source_positions=16, decoder_start_token_id=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


def _timm_loss(out, micro_batch):
    return torch.nn.functional.cross_entropy(out, micro_batch["y"])


def _images(size=32, steps=STEPS, classes=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        {"x": torch.randn(4, 3, size, size, generator=g), "y": torch.randint(0, classes, (4,), generator=g)}
        for _ in range(steps)
    ]


def _run_timm(name, combo, zero_stage=1, optimizer=common.adamw, export=False, size=32, **options):
    """A timm model with no family record (its stack, tokens and head placed by the anatomy) against
    the unsharded one; ``export``: the trained stages written back in timm's own layout."""
    import copy

    from tests.policies.plain_models import timm_model

    model = timm_model(name, **options)
    spec = pipeline_spec_for(model)
    assert isinstance(spec.stage_forward, AnatomyStageForward)
    ref = copy.deepcopy(model)
    engine = _check(
        name, *combo, zero_stage=zero_stage, model_pair=(ref, model), data=_images(size), loss_fn=_timm_loss,
        optimizer=optimizer,
    )  # fmt: skip
    if export:
        _export_matches(engine, ref, name, options)
    return spec


def _export_matches(engine, ref, name, options):
    """``save_pretrained`` after pp training: a fresh ``timm.create_model`` loads it strictly and holds
    the unsharded model's weights after the same steps."""
    import os

    import torch.distributed as dist
    from safetensors.torch import load_file

    from shardformer.checkpoint import save_pretrained
    from tests.checkpoint.common import remove_dir, shared_dir
    from tests.helpers import assert_close
    from tests.policies.plain_models import timm_model

    path = shared_dir()
    save_pretrained(engine.model, path)
    if dist.get_rank() == 0:
        fresh = timm_model(name, **options)  # the same architecture, seeded alike: every weight is replaced below
        with torch.no_grad():
            for p in fresh.parameters():
                p.add_(1.0)
        fresh.load_state_dict(load_file(os.path.join(path, "model.safetensors")))  # strict: timm's own names
        for key, value in ref.state_dict().items():
            assert_close(fresh.state_dict()[key], value, what=f"{name} export after pp=2: {key}")
    remove_dir(path)


def check_timm_beit_tp2_pp2_zero1_export():  # cls_token on the first stage, read there only
    _run_timm("beit", (2, 2, 1, "1f1b", 2, 0.5, "torch"), export=True)


def check_timm_eva02_tp2_pp2_zero3_export():  # rotary positions computed on every stage from buffers
    spec = _run_timm("eva02", (2, 2, 1, "gpipe", 2, None, "torch"), zero_stage=3, size=28, export=True)
    # the parameters it holds itself are read before the blocks: on the first stage
    assert spec.first == ("patch_embed", "cls_token", "pos_embed") and spec.last == ("fc_norm", "head")


def check_timm_swin_tp2_pp2_zero1():  # split between its stages (widths 16 and 32, a patch merging between)
    spec = _run_timm("swin", (2, 2, 1, "1f1b", 2, 0.5, "torch"), drop_path_rate=0.0)  # no random drop to compare
    assert spec.layers == "layers"  # its stages are the layers of the split


def check_plain_lm_tp2_pp2_and_dp2_zero1():  # a hand-written nn.Module: no config, no family record
    import copy

    from tests.policies.plain_models import plain_lm

    model = plain_lm()
    assert isinstance(pipeline_spec_for(model).stage_forward, AnatomyStageForward)
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 96, (4, 8), generator=g)
        # the reference calls model(x); the stage forward passes what the forward takes by name (tokens)
        data.append({"tokens": tokens, "x": tokens, "y": torch.randint(0, 96, (4, 8), generator=g)})
    for tp, pp, dp in ((2, 2, 1), (2, 1, 2)):  # pp=1: its own forward, given the inputs it takes
        model = plain_lm()
        _check(
            "plain", tp, pp, dp, "1f1b", 2, 0.5, "torch", model_pair=(copy.deepcopy(model), model), data=data,
            loss_fn=lambda out, b: torch.nn.functional.cross_entropy(out.flatten(0, 1), b["y"].flatten()),
            optimizer=common.sgd,  # its key biases' gradients are zero in theory: AdamW makes their rounding steps
        )  # fmt: skip


def check_convnext_tp2_pp2_zero1_sgd():  # a stage hands on a channels-last permute: sent contiguous both ways
    config = tf.ConvNextConfig(
        hidden_sizes=[8, 16], depths=[2, 2], num_stages=2, image_size=32, num_labels=3, drop_path_rate=0.0
    )
    pair = load_pair(tf.ConvNextForImageClassification, config)
    g = torch.Generator().manual_seed(0)
    data = [
        {"pixel_values": torch.randn(4, 3, 32, 32, generator=g), "labels": torch.randint(0, 3, (4,), generator=g)}
        for _ in range(STEPS)
    ]
    _check("convnext", 2, 2, 1, "1f1b", 2, 0.5, "torch", model_pair=pair, data=data)


def check_deit_image_classification_tp2_pp2_zero1():  # reads embeddings.patch_embeddings on every stage
    config = tf.DeiTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16,
        patch_size=8, num_labels=3,
    )  # fmt: skip
    pair = load_pair(tf.DeiTForImageClassification, config)
    g = torch.Generator().manual_seed(0)
    data = [
        {"pixel_values": torch.randn(4, 3, 16, 16, generator=g), "labels": torch.randint(0, 3, (4,), generator=g)}
        for _ in range(STEPS)
    ]
    _check("deit-hf", 2, 2, 1, "1f1b", 2, 0.5, "p2p", model_pair=pair, data=data, optimizer=common.adamw)


# DeBERTa-v3's setting: the encoder normalises its relative position embeddings once and hands them to every layer
DEBERTA_RELATIVE = dict(
    relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm",
    max_relative_positions=-1,
)  # fmt: skip


def check_deberta_v2_relative_attention_tp2_pp2():
    """Every stage holds ``encoder.rel_embeddings`` and ``encoder.LayerNorm`` and their gradients are summed
    over the stages: losses and weights after AdamW steps (pp=4's placement, middle stages included, is
    checked in one process: tests/pipeline/test_routes.py)."""
    engine = _run(
        "DebertaV2ForMaskedLM", (2, 2, 1, "1f1b", 2, 0.5, "torch"), optimizer=common.adamw, **DEBERTA_RELATIVE
    )
    encoder = engine.model.deberta.encoder
    assert encoder.rel_embeddings is not None and encoder.LayerNorm is not None, engine.mesh.pp_rank


def check_llava_vision_tower_on_the_first_stage_tp2_pp2():
    """A vision-language model: the vision tower and projector run on the first stage, which merges their
    output into the embeddings; the language model's layers are split; later stages take no pixels."""
    model = runnable_model("LlavaForConditionalGeneration")
    ref = copy.deepcopy(model)
    data = []
    for step in range(STEPS):
        batch = inputs_for(model, seed=step, batch=common.BATCH)
        data.append({**batch, "labels": batch["input_ids"].clone()})
    engine = _check("llava", 2, 2, 1, "1f1b", 2, 0.5, "torch", model_pair=(ref, model), data=data,
                    optimizer=common.adamw)  # fmt: skip
    tower = [n for n, _ in engine.model.named_parameters() if ".vision_tower." in n]
    assert bool(tower) == (engine.mesh.pp_rank == 0), (engine.mesh.pp_rank, tower[:2])


CHECKS = [
    check_llava_vision_tower_on_the_first_stage_tp2_pp2,
    check_deberta_v2_relative_attention_tp2_pp2,
    check_deit_image_classification_tp2_pp2_zero1,
    check_convnext_tp2_pp2_zero1_sgd,
    check_whisper_tp2_pp2_zero1_sgd,
    check_timm_beit_tp2_pp2_zero1_export,
    check_timm_eva02_tp2_pp2_zero3_export,
    check_timm_swin_tp2_pp2_zero1,
    check_plain_lm_tp2_pp2_and_dp2_zero1,
    check_bloom_causal_lm_tp2_pp2_zero3_sgd,
    check_bert_sequence_classification_tp2_pp2_zero2_sgd,
    check_gpt2_sequence_classification_tp2_pp2_zero1,
    check_sequence_parallel_gpt_neo_tp2_pp2_zero1_sgd,
    check_bart_tp2_pp2_interleaved_zero1,
    check_t5_tp2_pp2_zero2_sgd,
]
test_engine_anatomy_4_ranks = check_table(CHECKS, 4)


def test_anatomy_of_a_derived_decoder():
    """OPT registers its final norm before its layers: the order a forward runs them in decides."""
    model = tf.OPTForCausalLM(tiny_config(tf.OPTConfig))
    assert layer_stack(model) == "model.decoder.layers"
    assert final_norm(model) == "model.decoder.final_layer_norm"
    spec = pipeline_spec_for(model)
    assert spec.first == ("model.decoder.embed_positions",)
    assert spec.shared == ("model.decoder.embed_tokens",)  # tied to lm_head: on both end stages
    assert spec.last == ("model.decoder.final_layer_norm", "lm_head")


def test_an_encoder_decoder_splits_where_its_tiny_copy_proves_it_exact():
    """BART: stages cut inside either stack and across the boundary, each module with the layer next to it.
    Whisper's encoder embeds log-mel frames through convolutions that no stand-in answers for: a stage
    that starts inside its encoder is refused, naming why, while its decoder splits anywhere."""
    model = tf.BartForConditionalGeneration(tiny_config(tf.BartConfig, encoder_layers=4, decoder_layers=2))
    spec = pipeline_spec_for(model)
    assert (spec.layers, spec.second_layers) == ("model.encoder.layers", "model.decoder.layers")
    assert spec.second_start == tuple(
        f"model.decoder.{m}" for m in ("embed_tokens", "embed_positions", "layernorm_embedding")
    )
    assert spec.stage_forward.refusals == {}
    for pp, split in ((2, [4, 2]), (3, None), (4, None), (2, [3, 3])):
        check_pipeline_spec(spec, model, pp, split)
    stage = spec.keep_stage(model, 1, 3)  # layers 2-3 of the encoder: its end, not its start
    assert stage.model.encoder.embed_tokens is None and stage.model.decoder.embed_tokens is None
    whisper = tf.WhisperForConditionalGeneration(
        tiny_config(tf.WhisperConfig, encoder_attention_heads=4, decoder_attention_heads=4)
    )
    spec = pipeline_spec_for(whisper)
    check_pipeline_spec(spec, whisper, 3, [2, 2, 2])
    with pytest.raises(
        PipelineSpecError,
        match=r"starts inside the encoder is not exact on a tiny copy \(.*layers_per_stage=\[2, \.\.\.\]",
    ):
        check_pipeline_spec(spec, whisper, 4)


def test_a_head_registered_before_the_base_model_keeps_its_tie():
    """XLM-RoBERTa registers lm_head first, so its tied decoder weight is named lm_head.decoder.weight:
    the proof sums the stages' gradients by tensor, whatever name each stage knows it by."""
    spec = pipeline_spec_for(tf.XLMRobertaForMaskedLM(tiny_config(tf.XLMRobertaConfig)))
    assert spec.shared == ("roberta.embeddings.word_embeddings",) and spec.last == ("lm_head",)


@pytest.mark.parametrize(
    "cls, why",
    [
        (
            tf.CLIPModel,
            r"2 layer stacks \(text_model.encoder.layers, vision_model.encoder.layers\) that are not an enc",
        ),
        # one layer group applied at every depth: named, with what trains it instead
        (
            tf.AlbertForMaskedLM,
            r"applies one layer's weights at every depth \(albert.encoder.albert_layer_groups.0 runs .*"
            r"use pipeline_parallel_size=1: data parallelism and ZeRO",
        ),
        # layer 0 hands the position bias it computed to the others
        (tf.T5EncoderModel, r"layer 1 of 'encoder.block' reads argument 2 from what layer 0 returned besides"),
    ],
)
def test_splits_that_cannot_be_exact_are_refused_naming_why(cls, why):
    with pytest.raises(NotImplementedError, match=why):
        pipeline_spec_for(cls(tiny_config(cls.config_class)))


class _ScaledAfterEachBlock(torch.nn.Module):
    """A root parameter read while the layers run (after every block): no one stage can hold it."""

    def __init__(self):
        from tests.policies.plain_models import PlainBlock

        super().__init__()
        self.embed = torch.nn.Embedding(96, 32)
        self.blocks = torch.nn.ModuleList(PlainBlock(32, 4) for _ in range(3))
        self.scale = torch.nn.Parameter(torch.ones(32))
        self.head = torch.nn.Linear(32, 96)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x) * self.scale
        return self.head(x)


def test_a_parameter_held_by_the_model_and_read_while_the_layers_run_is_refused():
    from tests.policies.plain_models import timm_model

    with pytest.raises(NotImplementedError, match=r"scale runs \(or is read\) while the layers blocks of _Scaled"):
        pipeline_spec_for(_ScaledAfterEachBlock())
    # CaiT's class token joins between its two stacks
    with pytest.raises(NotImplementedError, match=r"2 layer stacks \(blocks, blocks_token_only\) that are not an"):
        pipeline_spec_for(timm_model("cait"))
