"""The tiny-copy recipe every proof runs on builds copies that run, for classes it used to fail on.

Single process, tiny models: each class is scaled down from a config (its default, or a user's
small one), built and run forward on the recipe's inputs, the way the proof and the sweeps use it.
"""

import math

import pytest
import torch
import transformers as tf

from shardformer.core.grid_inputs import FRAMED_PATCHES, framed_patches, pooled_patches
from shardformer.core.inputs import make_inputs
from shardformer.core.tiny import fill_zero_matrices, tiny_copy_config
from shardformer.core.tiny_layers import kept_layers, layer_overrides
from shardformer.core.tiny_run import MAX_PARAMS, TinyCopyError, runnable_tiny_config
from shardformer.tools.verify import checking_mode

# class -> the user's config (None: the class's default): each failed to give a tiny copy that runs
FORMERLY_BROKEN = {
    "CodeGenForCausalLM": None,  # rotary width of the full head (the plan sweep's recipe)
    "GPTJForCausalLM": None,
    "FalconH1ForCausalLM": None,  # Mamba head sizes derived from others; read-only layers_block_type
    "DebertaV2ForSequenceClassification": dict(  # a pooler as wide as the user's hidden 64, below the old cutoff
        hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=2
    ),
    "DoryForCausalLM": None,
    "LaraMiniForCausalLM": None,  # linear-attention value heads a multiple of its key heads
    "Qwen3NextForCausalLM": None,  # the first full-attention layer is the fourth
    "MambaForCausalLM": None,  # layer_types is a read-only property
    "XLNetForSequenceClassification": None,  # d_head computed from d_model // n_head
    "Gemma4ForCausalLM": None,  # heterogeneous per-layer config: head_dim per layer
}


def _run(model_class, config):
    torch.manual_seed(0)
    model = model_class(config)
    fill_zero_matrices(model)
    model.eval()
    with torch.no_grad():
        return model(**make_inputs(model, seed=0))


@pytest.mark.parametrize("name", sorted(FORMERLY_BROKEN))
def test_tiny_copy_runs(name):
    model_class = getattr(tf, name)
    options = FORMERLY_BROKEN[name]
    config = model_class.config_class(**(options or {}))
    tiny = runnable_tiny_config(model_class, config, tp=2)
    assert type(tiny) is type(config)
    _run(model_class, tiny)
    with torch.device("meta"):
        assert sum(p.numel() for p in model_class(tiny).parameters()) <= MAX_PARAMS  # small, whichever scaling ran


def test_one_layer_of_each_kind_is_kept():
    """Qwen3-Next's schedule (three linear-attention layers, then full attention) keeps one of each, in
    order; lists of layer indices and per-layer overrides follow the kept layers; a stack of one kind
    keeps the first two layers as before."""
    tiny = tiny_copy_config(tf.Qwen3NextConfig(), tp=2)
    assert tiny.num_hidden_layers == 2 and tiny.layer_types == ["linear_attention", "full_attention"]
    data = {"num_hidden_layers": 6, "layer_types": ["a", "a", "b", "a", "a", "b"], "moe_layers": [1, 4]}
    assert kept_layers(data, {}) == [0, 1, 2]  # a, a in the MoE list, b
    assert kept_layers({"num_hidden_layers": 6, "layer_types": ["a"] * 6}, {}) == [0, 1]
    assert kept_layers({"num_hidden_layers": 6}, {}) is None
    # layers a list of indices marks without a schedule (GraniteSpeech5's subsampling blocks, a class of their
    # own): two of the others, so that one class repeats
    assert kept_layers({"num_hidden_layers": 16, "subsample_layers": [0, 1]}, {}) == [0, 2, 3]
    # Mllama's cross-attention layers are a class of their own: two of each kind keep each class a stack
    assert kept_layers({"num_hidden_layers": 10, "cross_attention_layers": [3, 8]}, {}) == [0, 1, 3, 8]
    # a copy of a copy (LFM3-VL's two vision layers, a convolution then attention): its schedule as it is
    assert kept_layers({"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"]}, {}) == [0, 1]
    # each layer's source of keys and values (Mistral Large 4): a kept layer's source is kept, renumbered
    sources = [0, 1, 2, 2, 4, 5, 6, 7]
    data = {"num_hidden_layers": 8, "layer_types": list("aaabaaaa"), "kv_source_layers": sources}
    assert kept_layers(data, {}) == [0, 2, 3]  # a, b's source, b
    assert layer_overrides(data, {}, [0, 2, 3], lambda key: True, dict)["kv_source_layers"] == [0, 1, 1]
    mistral = tiny_copy_config(tf.MistralLarge4Config(), tp=2).get_text_config()
    assert mistral.num_hidden_layers < 8 and mistral.kv_source_layers == list(range(mistral.num_hidden_layers))
    gemma4 = tiny_copy_config(tf.Gemma4TextConfig(), tp=2)
    assert gemma4.layer_types == ["sliding_attention", "full_attention"]
    assert gemma4.to_dict()["per_layer_config"] == {
        "1": {"head_dim": 2 * gemma4.to_dict()["head_dim"]}
    }  # twice as wide, as in full
    # MoE layers kept: DeepSeek-V3's 3 leading dense layers, NLLB-MoE's MoE layer every 4th
    assert tiny_copy_config(tf.DeepseekV3Config(), tp=2).first_k_dense_replace == 1
    nllb = tiny_copy_config(tf.NllbMoeConfig(), tp=2)
    assert nllb.encoder_sparse_step == nllb.decoder_sparse_step == 2 == nllb.encoder_layers


def test_no_scaling_that_runs_names_each_attempt():
    """A class whose copy never runs (here: the forward needs an input the recipe cannot give) is
    reported with every scaling's error, not built half-way."""

    def no_inputs(model, seed):
        raise KeyError("bbox")

    with pytest.raises(TinyCopyError, match=r"does not run \(scaled: inputs: KeyError.*keep widths"):
        runnable_tiny_config(tf.LlamaForCausalLM, tf.LlamaConfig(num_hidden_layers=3), tp=2, inputs=no_inputs)


class _WideOnlyConfig(tf.LlamaConfig):  # a validator refusing every scaled width (Dots3 Note's, FunASR-Nano's)
    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.hidden_size < 64:
            raise ValueError("hidden_size below 64")


def test_a_refused_scaling_is_named():
    """When the config class refuses every scaled copy, the copies that keep the widths are refused as too large:
    the report names the scaled copy's refusal too, the real cause (a depth unlike the test above's: copies are
    cached by config)."""
    with pytest.raises(TinyCopyError, match=r"scaled: refused: ValueError: hidden_size below 64; keep widths: \d+M"):
        runnable_tiny_config(tf.LlamaForCausalLM, _WideOnlyConfig(num_hidden_layers=5), tp=2)


def test_no_dropout_of_any_kind():
    """Stochastic depth and LayerDrop are dropout too: a tiny BEiT with its default drop_path_rate=0.1
    trained at pp=2 differed from its unsharded copy by the layers each dropped, not by the split; a
    token classifier's head with no classifier dropout in its config dropped 10%."""
    from shardformer.core.tiny import tiny_config

    beit = tiny_config(tf.BeitConfig)
    assert beit.drop_path_rate == 0.0 and beit.hidden_dropout_prob == 0.0
    assert tiny_config(tf.HubertConfig).layerdrop == 0.0
    # transformers' generic token-classification head drops 10% where the config sets no classifier dropout
    llama = tf.LlamaForTokenClassification(tiny_copy_config(tf.LlamaConfig()))
    assert llama.dropout.p == 0.0
    # a router's jitter noise is randomness too: Switch's (0.01) made its proof compare two noise draws
    assert tiny_config(tf.SwitchTransformersConfig).router_jitter_noise == 0.0


def test_audio_copies_run_on_waveforms_and_log_mels():
    """wav2vec2 takes a waveform its feature encoder (seven strided convolutions, kept narrow) turns into
    a few frames, and its CTC head a transcript that fits them; Whisper's encoder takes log-mel frames
    as many as its positions need. SpecAugment's random masks are off, as dropout is."""
    ctc = tf.Wav2Vec2ForCTC(runnable_tiny_config(tf.Wav2Vec2ForCTC, tf.Wav2Vec2Config(), tp=2))
    assert max(ctc.config.conv_dim) < 512 and ctc.config.mask_time_prob == 0.0
    inputs = make_inputs(ctc, seed=0)
    frames = ctc._get_feat_extract_output_lengths(inputs["input_values"].shape[1])
    assert inputs["labels"].shape[1] <= frames // 2 and (inputs["labels"] != ctc.config.pad_token_id).all()
    assert torch.isfinite(_run(tf.Wav2Vec2ForCTC, ctc.config).loss)
    whisper = runnable_tiny_config(tf.WhisperForAudioClassification, tf.WhisperConfig(), tp=2)
    out = _run(tf.WhisperForAudioClassification, whisper)
    assert out.logits.shape == (2, whisper.num_labels) and torch.isfinite(out.loss)


def _tiny(name, **options):
    model_class = getattr(tf, name)
    torch.manual_seed(0)
    model = model_class(runnable_tiny_config(model_class, model_class.config_class(**options), tp=2)).eval()
    return model, make_inputs(model, seed=0)


def test_inputs_follow_the_models_own_conventions():
    """What each model's processor would give: LLaVA-NeXT an image the size of its first (scaled) grid,
    cut into that many tiles plus the whole, and one image token per feature; a classifier over Gemma 3
    image tokens counted by its base model; Bros one ordered box per token; LXMERT region features and
    positions; a T5 classifier exactly one end-of-sequence token per sample; X-MOD a chosen language."""
    llava, x = _tiny("LlavaNextForConditionalGeneration")
    side = llava.config.vision_config.image_size
    height, width = llava.config.image_grid_pinpoints[0]
    assert max(max(p) for p in llava.config.image_grid_pinpoints) <= 3 * side  # scaled with the tiny tower
    assert x["image_sizes"].tolist() == [[height, width]] * 2
    assert x["pixel_values"].shape[:2] == (2, 1 + (height // side) * (width // side))
    gemma, x = _tiny("Gemma3ForSequenceClassification")
    assert (x["input_ids"] == gemma.config.image_token_index).sum(1).tolist() == [gemma.config.mm_tokens_per_image] * 2
    # the same image tokens for a float64 copy (verify's rerun): the tower is probed with float64 images
    deepseek, x = _tiny("DeepseekVLHybridForConditionalGeneration")
    image = deepseek.config.image_token_id
    x64 = make_inputs(deepseek.double(), seed=0)
    assert (x["input_ids"] == image).any() and torch.equal(x64["input_ids"] == image, x["input_ids"] == image)
    bros, x = _tiny("BrosForTokenClassification")
    assert x["bbox"].shape == (*x["input_ids"].shape, 4) and (x["bbox"][..., :2] <= x["bbox"][..., 2:]).all()
    lxmert, x = _tiny("LxmertForQuestionAnswering")
    assert x["visual_feats"].shape[-1] == lxmert.config.visual_feat_dim and x["visual_pos"].shape[-1] == 4
    t5, x = _tiny("T5ForSequenceClassification")
    assert (x["input_ids"] == t5.config.eos_token_id).sum(1).tolist() == [1, 1]
    xmod, x = _tiny("XmodForSequenceClassification")
    assert xmod.config.default_language == xmod.config.languages[0]
    for model, inputs in (_tiny(n) for n in ("LlavaNextForConditionalGeneration", "CanineForTokenClassification")):
        with torch.no_grad():
            assert torch.isfinite(model(**inputs).loss if "labels" in inputs else model(**inputs).logits).all()


def test_inputs_of_tiles_images_per_sample_and_perceivers_pixels():
    """Mllama's processor's tiles (one used, its aspect ratio id 1) with a cross-attention mask per text
    token; Idefics's images per sample with theirs; Kosmos-2's image slots; Perceiver's image classifiers
    take pixels (their main input is named ``inputs``). Shapes only: the models are built on the meta device."""

    def inputs(model_class):
        with torch.device("meta"):
            model = model_class(tiny_copy_config(model_class.config_class()))
        return make_inputs(model, seed=0)

    x = inputs(tf.MllamaForConditionalGeneration)
    tiles = x["pixel_values"].shape[2]
    assert x["pixel_values"].dim() == 6 and x["aspect_ratio_ids"].tolist() == [[1], [1]]
    assert x["aspect_ratio_mask"].tolist() == [[[1] + [0] * (tiles - 1)]] * 2
    assert x["cross_attention_mask"].shape == (*x["input_ids"].shape, 1, tiles)
    x = inputs(tf.IdeficsForVisionText2Text)
    assert x["pixel_values"].dim() == 5 and x["image_attention_mask"].shape == (*x["input_ids"].shape, 1)
    x = inputs(tf.Kosmos2ForConditionalGeneration)  # its image slots (one per latent query) before the text
    slots = x["image_embeds_position_mask"]
    assert slots.shape == x["input_ids"].shape and slots.sum(1).tolist() == [x["input_ids"].shape[1] - 8] * 2
    x = inputs(tf.PerceiverForImageClassificationLearned)
    assert list(x) == ["pixel_values"] and x["pixel_values"].dim() == 4


def test_configs_the_recipe_used_to_refuse():
    """ResNet's ``layer_types`` is the class's list of allowed kinds, not a schedule of layers (no
    "full_attention" appended); Perceiver sizes by ``d_model`` (it names no ``hidden_size``) and a
    single cross-attention head stays one (its image classifiers' Fourier features: 261 channels); image
    and patch sizes given as ``[height, width]`` (InternVL) or per stage (Florence 2) are scaled as given."""
    assert tiny_copy_config(tf.ResNetConfig()).layer_type == "bottleneck"
    perceiver = tiny_copy_config(tf.PerceiverConfig(num_cross_attention_heads=1))
    assert perceiver.num_cross_attention_heads == 1 and perceiver.d_latents < tf.PerceiverConfig().d_latents
    internvl = tiny_copy_config(tf.InternVLConfig()).vision_config
    assert internvl.image_size == [32, 32] and internvl.patch_size == [8, 8]  # 4 x 4 patches, shuffled to 2 x 2
    assert tiny_copy_config(tf.Florence2Config()).vision_config.patch_size == [7, 3, 3, 3]


def test_what_a_default_config_leaves_unset_is_filled():
    """Default configs that build no model (their checkpoints set the values) are completed as transformers'
    configs derive them: LFM2-MoE's schedule (every layer attention), Dots1's expert counts, CohereCompass's
    RoPE (one per kind of layer), MoonshineStreaming's undeclared key/value heads; a scaled copy of a uniform
    schedule keeps it where the class does not recompute it. Built on the meta device: no memory."""
    import torch

    from shardformer.core.tiny_defaults import complete_unset

    for model_class in (tf.Lfm2MoeForCausalLM, tf.Dots1ForCausalLM, tf.CohereCompassForCausalLM):
        config = model_class.config_class()
        with torch.device("meta"), pytest.raises((TypeError, KeyError)):
            model_class(config)
        complete_unset(config)
        with torch.device("meta"):
            model_class(config)
    lfm, dots = tf.Lfm2MoeConfig(), tf.Dots1Config(n_shared_experts=2)
    complete_unset(lfm), complete_unset(dots)
    assert lfm.layer_types == ["full_attention"] * lfm.num_hidden_layers
    assert (dots.n_routed_experts, dots.num_experts_per_tok, dots.n_shared_experts) == (4, 2, 2)  # set: kept
    assert tiny_copy_config(lfm).layer_types == ["full_attention"] * 2
    compass = tf.CohereCompassTextConfig()
    complete_unset(compass)
    assert compass.rope_parameters["full_attention"]["rope_type"] == "default"
    moonshine = tf.MoonshineStreamingConfig()
    complete_unset(moonshine)
    assert moonshine.num_key_value_heads == moonshine.num_attention_heads


def test_a_backward_that_refuses_eval_mode_is_checked_in_training_mode():
    """Reformer computes gradients only in training mode (its reversible layers recompute activations
    there): verify checks it in training mode with dropout 0, its tiny copy's sequence sizes fitted to the
    inputs (axial positions, attention chunks) and its hashing seeded, so that two runs compute alike."""
    reformer, x = _tiny("ReformerForSequenceClassification")
    with pytest.raises(AssertionError, match=r"model\.train\(\)"):
        reformer(**x).loss.backward()
    assert reformer.config.hash_seed == 0 and math.prod(reformer.config.axial_pos_shape) == x["input_ids"].shape[1]
    checking_mode(reformer, training=True)
    first = reformer(**x).loss
    first.backward()
    assert reformer.training and torch.equal(first, reformer(**x).loss)


def test_inputs_of_patches_codebooks_and_fixed_lengths():
    """SigLIP 2 takes its image as flattened patches with their grid and mask; MusicGen's decoder ids
    per codebook and labels per frame and codebook; Perceiver's masked LM text padded to its positions
    (one decoder query each); a question-answering pair with its three separators (Longformer)."""
    siglip, x = _tiny("Siglip2ForImageClassification")
    vision = siglip.config.vision_config
    patches = x["spatial_shapes"][0].prod().item()
    assert x["pixel_values"].shape == (2, patches, vision.num_channels * vision.patch_size**2)
    assert patches <= vision.num_patches and x["pixel_attention_mask"].shape == (2, patches)
    musicgen, x = _tiny("MusicgenForCausalLM")
    books = musicgen.config.num_codebooks
    assert x["input_ids"].shape[0] == 2 * books and x["labels"].shape == (2, x["input_ids"].shape[1], books)
    perceiver, x = _tiny("PerceiverForMaskedLM")
    assert x["input_ids"].shape[1] == perceiver.config.max_position_embeddings
    longformer, x = _tiny("LongformerForQuestionAnswering")
    assert (x["input_ids"] == longformer.config.sep_token_id).sum(1).tolist() == [3, 3]
    for model, inputs in (
        (siglip, _tiny("Siglip2ForImageClassification")[1]),
        (musicgen, _tiny("MusicgenForCausalLM")[1]),
    ):
        with torch.no_grad():
            assert torch.isfinite(model(**inputs).loss)


def test_inputs_found_in_sub_configs():
    """The image size of VisionEncoderDecoder is its encoder's, and T5Gemma 2's that of the vision tower
    inside its encoder; Marian's decoder vocabulary follows the tiny one; Gemma 4's default config has no
    vision tower, so its inputs hold no images."""
    ved, x = _tiny("VisionEncoderDecoderModel")
    assert x["pixel_values"].shape[-1] == ved.config.encoder.image_size and "decoder_input_ids" in x
    t5gemma, x = _tiny("T5Gemma2ForConditionalGeneration")
    assert x["pixel_values"].shape[-1] == t5gemma.config.encoder.vision_config.image_size
    marian = tiny_copy_config(tf.MarianConfig())
    assert marian.decoder_vocab_size == marian.vocab_size
    gemma4, x = _tiny("Gemma4ForConditionalGeneration")
    assert gemma4.config.vision_config is None and "pixel_values" not in x


def test_inputs_of_videos_policies_and_tied_widths():
    """VideoPrism takes clips of num_frames pictures; InstructBLIP-Video 4 frames with one video token per
    query per frame; PI0 its robot state and the noise and timestep its loss would draw; the copy keeps the
    ties between widths its config holds (ALIGN's projection is its convnet's last channels, Aria's
    patch-to-query table names the copy's patch count). Built from the first scaling, without a forward."""

    def built(name, **options):
        model_class = getattr(tf, name)
        torch.manual_seed(0)
        model = model_class(tiny_copy_config(model_class.config_class(**options))).eval()
        return model, make_inputs(model, seed=0)

    prism, x = built("VideoPrismClipModel")
    vision = prism.config.vision_config
    assert x["pixel_values_videos"].shape == (2, vision.num_frames, 3, vision.image_size, vision.image_size)
    video, x = built("InstructBlipVideoForConditionalGeneration", video_token_index=100)
    assert x["pixel_values"].shape[1] == 4
    assert (x["input_ids"] == video.config.video_token_index).sum(1).tolist() == [4 * video.config.num_query_tokens] * 2
    pi0, x = built("PI0ForConditionalGeneration")
    assert x["state"].shape == (2, pi0.config.max_state_dim) and x["pixel_attention_mask"].shape == (2, 1)
    align = tiny_copy_config(tf.AlignConfig())
    assert align.projection_dim == round(align.vision_config.out_channels[-1] * align.vision_config.width_coefficient)
    aria = tiny_copy_config(tf.AriaConfig())
    assert list(aria.projector_patch_to_query_dict) == [(aria.vision_config.image_size // 8) ** 2]


def test_vision_language_copies_keep_their_ties():
    """Widths and counts a vision-language config ties across its towers stay tied in the copy: Janus's and
    Florence 2's vision projection is the text's width, Unlimited OCR's SAM channels feed its CLIP encoder,
    Cosmos 3 Edge's position table is a square of patches, Ernie 4.5 VL's height and width rotary sections stay
    equal and its experts' widths split over 2 ranks; NemotronH Omni's patches come with a grid without time."""
    janus = tiny_copy_config(tf.JanusConfig(vision_config={"projection_dim": 4096}))
    assert janus.vision_config.projection_dim == janus.text_config.hidden_size
    florence = tiny_copy_config(tf.Florence2Config())
    assert florence.vision_config.projection_dim == florence.text_config.hidden_size
    ocr = tiny_copy_config(tf.UnlimitedOcrConfig()).vision_config
    assert ocr.sam_config.downsample_channels[-1] == ocr.encoder_config.hidden_size
    assert tiny_copy_config(tf.Cosmos3EdgeConfig()).vision_config.num_patches == 16
    rope = {"rope_type": "default", "rope_theta": 5e5, "mrope_section": [22, 22, 20]}
    ernie = tiny_copy_config(tf.Ernie4_5_VLMoeConfig(text_config={"rope_parameters": rope})).text_config
    assert ernie.rope_parameters["mrope_section"] == [1, 1, 2]
    assert all(w % 8 == 0 for w in ernie.moe_intermediate_size), ernie.moe_intermediate_size

    class Omni(torch.nn.Module):
        config = tf.PretrainedConfig(vision_config=tf.PretrainedConfig(patch_size=8, num_channels=3))

        def forward(self, input_ids, pixel_values=None, image_grid_hw=None):
            return input_ids

    from shardformer.core.inputs import _images

    x = _images(Omni(), Omni.config, 2, torch.Generator().manual_seed(0))
    assert x["image_grid_hw"].tolist() == [[2, 2]] * 2 and x["pixel_values"].shape == (8, 3 * 8 * 8)


def test_inputs_of_speech_towers_and_generate_as_processors_make_them():
    """OmniASR's feature extractor gives a waveform with a channel, ``[batch, 1, samples]``, and its CTC loss
    reads the lengths from ``padding_mask``; Granite Speech's mel bins come delta-expanded and paired (4 x
    ``num_mel_bins``); Pop2Piano's generate reads only ``input_features`` (so its forward does too); Dia's
    decoder and Kyutai's read a code per channel (codebook) at each step; Voxtral Realtime adds audio frames
    to every token; RWKV
    runs uncached (eval mode's cache writes its state in place, which backward cannot pass); Inkling's head
    scores only its ``unpadded_vocab_size``, which stays inside the copy's vocabulary. Meta-device builds."""

    def built(name):
        model_class = getattr(tf, name)
        with torch.device("meta"):
            model = model_class(tiny_copy_config(model_class.config_class()))
        return model, make_inputs(model, seed=0)

    omni, x = built("OmniASRForCTC")
    assert x["input_values"].shape[:2] == (2, 1) and x["padding_mask"].shape == (2, x["input_values"].shape[-1])
    granite, x = built("GraniteSpeech5ForCTC")
    assert x["input_features"].shape[-1] == 4 * granite.config.encoder_config.num_mel_bins
    pop2piano, x = built("Pop2PianoForConditionalGeneration")
    assert set(x) == {"input_features", "labels"} and x["input_features"].shape[-1] == pop2piano.config.d_model
    assert built("RwkvForCausalLM")[1]["use_cache"] is False
    dia, x = built("DiaForConditionalGeneration")  # decoder codes per step and channel; cross-attends the encoder
    channels = dia.config.decoder_config.num_channels
    assert x["decoder_input_ids"].shape == (2, x["labels"].shape[1], channels) and len(x["labels"]) == 2 * channels
    assert dia.config.decoder_config.cross_hidden_size == dia.config.encoder_config.hidden_size
    kyutai, x = built("KyutaiSpeechToTextForConditionalGeneration")  # a text token and a code per codebook a step
    assert x["input_ids"].shape[-1] == 1 + kyutai.config.num_codebooks
    assert kyutai.config.codebook_vocab_size == kyutai.config.codec_config.codebook_size + 1
    voxtral, x = built("VoxtralRealtimeForConditionalGeneration")  # its audio added to each token: frames per token
    per_token = voxtral.config.audio_length_per_tok
    assert x["input_features"].shape == (
        2,
        voxtral.config.audio_config.num_mel_bins,
        per_token * x["input_ids"].shape[1],
    )
    inkling = tiny_copy_config(tf.Inkling2TextConfig())
    assert inkling.vocab_size // 2 < inkling.unpadded_vocab_size < inkling.vocab_size


def test_validated_ties_are_kept():
    """Widths a config validates against each other stay tied in the copy (dicts only: milliseconds):
    Dots3 Note's sliding head (unrotated + rotated = head_dim) and its layers' fewer experts (at least top-k),
    adapters' widths tied to the text's hidden size (Dots3 Note, FunASR-Nano), M-RoPE's rotated part a multiple
    of 4 (NeoMME rotates a quarter of its head); a per-layer config has no global head count to read."""
    from shardformer.core.tiny_rotary import rotary_head_dim
    from shardformer.core.tiny_widths import scale_override, tie_adapter_to_text
    from shardformer.policies.tp_plan.heads import head_sizes

    data = {"head_dim": 256, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "num_local_experts": 64}
    sizes = {"head_dim": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "num_local_experts": 4}
    sizes["num_experts_per_tok"] = 2
    assert scale_override({"qk_nope_head_dim": 192}, sizes, data) == {"qk_nope_head_dim": 4}  # 4 + 4 = 8
    assert scale_override({"num_local_experts": 4}, sizes, data) == {"num_local_experts": 2}
    data = {"text_config": {"hidden_size": 1024}, "adaptor_config": {"hidden_size": 512, "intermediate_size": 256}}
    out = {"text_config": {"hidden_size": 32}, "adaptor_config": {"hidden_size": 32, "intermediate_size": 64}}
    tie_adapter_to_text(out, data)
    assert out["adaptor_config"] == {"hidden_size": 32, "intermediate_size": 8}  # a quarter of the text's
    rope = {"full_attention": {"partial_rotary_factor": 0.25}, "sliding_attention": {"partial_rotary_factor": 1.0}}
    assert rotary_head_dim({"head_dim": 64, "rope_parameters": rope}, 8) == 16  # rotates 4 of 16, not 2 of 8
    assert rotary_head_dim({"head_dim": 64, "rope_parameters": {"rope_type": "default"}}, 8) == 8
    dots3 = tiny_copy_config(tf.Dots3NoteTextConfig(), tp=2)
    assert head_sizes(dots3) is None


def test_zero_widths_latent_rotaries_and_audio_lengths_are_kept():
    """Configs only (milliseconds): Glm5Next's NoPE head (``qk_rope_head_dim`` 0, validated) stays without a
    rotary; HYV4VL's M-RoPE sections add up to its latent attention's rotated pairs (``qk_rope_head_dim``, not
    ``head_dim``); VibeVoice ASR's chunk of audio samples stays a multiple of its tokenizer's hop (validated),
    and its tokenizer's channels, doubled at each of six downsamplings, end at 64 at most (not 2048)."""
    assert tiny_copy_config(tf.Glm5NextTextConfig()).qk_rope_head_dim == 0
    text = tiny_copy_config(tf.HYV4VLConfig()).text_config
    assert sum(text.rope_parameters["mrope_section"]) == text.qk_rope_head_dim // 2
    asr = tiny_copy_config(tf.VibeVoiceAsrConfig())
    tokenizer = asr.acoustic_tokenizer_encoder_config
    assert asr.acoustic_tokenizer_chunk_size % tokenizer.hop_length == 0
    assert tokenizer.num_filters * 2 ** len(tokenizer.downsampling_ratios) <= 64


def test_inputs_of_patches_per_image_token():
    """Inkling 2's processor gives one channels-last picture per image token (a 2 x 2 merge of patches) and
    counts its grid in image tokens: the tower's inputs have that shape, and its tiny tower runs on them."""
    from shardformer.core.grid_inputs import grid_images

    vision = tiny_copy_config(tf.Inkling2Config()).vision_config
    g = torch.Generator().manual_seed(0)
    grid = grid_images(vision, "inkling2", {}, "image_grid_thw", 3, 2, g)
    side = vision.patch_size * vision.spatial_merge_size
    assert grid["pixel_values"].shape == (8, side, side, 3) and grid["image_grid_thw"].tolist() == [[1, 2, 2]] * 2
    with torch.no_grad():
        assert tf.Inkling2VisionModel(vision)(**grid).pooler_output.shape[0] == 8  # one per image token


def test_codebooks_whose_codes_are_text_tokens_fit_the_tiny_vocabulary():
    """Dicts only (milliseconds): Chameleon's and Emu3's token map keeps the names of the tiny codebook's codes and
    the bracketed names, re-numbered inside the vocabulary with the ids the config read from it; Apertus 1.5's code
    ranges stay end to end (its validator's rule); a VQ-VAE's norms keep 32 groups, its attention its last stage's
    width, its resolution the tiny image's."""
    from shardformer.core.tiny import VOCAB
    from shardformer.core.tiny_vocab_map import CODES, fit_code_ranges, fit_vocabulary_map
    from shardformer.core.tiny_widths import fit_convnet

    names = {"<image>": 8711, "hello": 5, **{f"IMGIMG{c}Z": 4 + c for c in range(200)}}
    data = {"vocabulary_map": names, "image_token_id": 8711, "vq_config": {"num_embeddings": 8192}}
    out = {"vq_config": {}}
    fit_vocabulary_map(out, data, VOCAB)
    tiny = out["vocabulary_map"]
    assert out["vq_config"] == {"num_embeddings": CODES} and "hello" not in tiny
    assert sum(n.startswith("IMGIMG") for n in tiny) == CODES and "IMGIMG0Z" in tiny and "IMGIMG31Z" in tiny
    assert out["image_token_id"] == tiny["<image>"] and len(set(tiny.values())) == len(tiny)
    assert max(tiny.values()) < VOCAB
    data = {"image_token_offset": 131272, "audio_token_offset": 262344, "vocab_size": 266752}
    data |= {"vision_config": {"codebook_size": 131072}, "audio_config": {"codebook_size": 4096}}
    out = {"vision_config": {}, "audio_config": {}}
    fit_code_ranges(out, data, VOCAB)
    assert out["image_token_offset"] + out["vision_config"]["codebook_size"] == out["audio_token_offset"]
    assert out["audio_token_offset"] + out["audio_config"]["codebook_size"] <= VOCAB
    out = {"base_channels": 8, "hidden_size": 32}
    fit_convnet(out, {"base_channels": 256, "channel_multiplier": [1, 2, 4], "hidden_size": 1024})
    assert out == {"base_channels": 32, "hidden_size": 128}
    out = {}
    fit_convnet(out, {"resolution": 256, "attn_resolutions": [16], "base_channels": 100})
    assert out == {"resolution": 32, "attn_resolutions": [2]}


def test_timm_towers_are_scaled_by_their_own_arguments():
    """A timm tower inside a transformers config (meta-device builds of one ViT: FastViT's and MobileNet-V5's
    take seconds, and run in the sweep's rows): PE-Core's width, heads, depth and image as its model_args give
    them; Gemma 3n's image tokens the tiny MobileNet-V5's output grid (dicts only)."""
    from shardformer.core.tiny_timm import GRID, fit_timm_tower, tie_tokens_per_image

    pe = {"architecture": "vit_pe_core_tiny_patch16_384", "model_args": {"embed_dim": 192, "depth": 12}}
    pe["model_args"] |= {"img_size": [384, 384], "ref_feat_shape": [24, 24]}
    out = {}
    fit_timm_tower(out, pe, hidden=32, heads=4)
    expected = {"embed_dim": 32, "num_heads": 4, "depth": 2, "img_size": (64, 64), "ref_feat_shape": (GRID, GRID)}
    assert out["model_args"] == expected
    data = {"vision_soft_tokens_per_image": 256, "vision_config": {"model_args": None}}
    out = {"vision_config": {"model_args": {"msfa_output_resolution": GRID}}}
    tie_tokens_per_image(out, data)
    assert out["vision_soft_tokens_per_image"] == GRID * GRID


def test_indices_into_the_vision_tower_follow_its_depth():
    """Dicts only: Molmo2's adapter reads vision layers [24, 18] (and -1) of 27; the copy's tower has 2."""
    from shardformer.core.tiny_layers import fit_tower_indices

    data = {"vision_config": {"num_hidden_layers": 27}, "adapter_config": {"vision_feature_layer": [24, 18, -1]}}
    out = {"vision_config": {"num_hidden_layers": 2}, "adapter_config": {}}
    fit_tower_indices(out, data)
    assert out["adapter_config"]["vision_feature_layer"] == [1, 1, -1]


def test_a_tower_folding_its_patch_keeps_a_layer_per_scale():
    """Inkling's vision encoder folds its patch one scale a layer (the pixels, then a prime factor of the patch's
    side or of its frames each): its copy keeps a layer per scale (fewer need scipy's solver); a ViT does not."""
    vision = tiny_copy_config(tf.InklingConfig()).vision_config
    assert (vision.patch_size, vision.temporal_patch_size, vision.num_hidden_layers) == (8, 2, 1 + 3 + 1)
    assert tiny_copy_config(tf.HunYuanVLConfig()).vision_config.num_hidden_layers == 2
    # its processor's patches: clips of the tower's frames, channels last, one image token each
    patches = framed_patches(vision, vision.num_channels, 2, torch.Generator().manual_seed(0))["pixel_values"]
    assert patches.shape == (8, 2, 8, 8, 3) and vision.model_type in FRAMED_PATCHES


def test_molmo2_pools_flattened_patches_into_its_image_tokens():
    """Molmo2's adapter projects to the text's width (``text_hidden_size``, tied by its name: its default config's
    3584 is not its text's 4096), its image token is an id (``image_patch_id``), and its images are the processor's:
    flattened patches, as many as its position table, pooled into tokens by an index table."""
    molmo = tiny_copy_config(tf.Molmo2Config())
    assert molmo.adapter_config.text_hidden_size == molmo.text_config.hidden_size
    assert molmo.image_token_id < molmo.text_config.vocab_size
    vision = molmo.vision_config
    x = pooled_patches(vision, vision.num_channels, 2, torch.Generator().manual_seed(0))
    assert x["pixel_values"].shape == (2, vision.num_position_embeddings, 3 * vision.patch_size**2)
    assert x["image_token_pooling"].max() < 2 * vision.num_position_embeddings
    assert x["image_grids"][:, :2].prod(-1).sum() == len(x["image_token_pooling"])


def test_granite4_vision_fits_its_deepstack_and_qformer_to_the_copy():
    """Granite 4 Vision: its deepstack (vision layer -> decoder layer pairs) and spatial target layers renumbered for
    the copy's depths, its Q-Former (a head per 64 vision features) two heads wide, its Q-Former's windows inside the
    tiny patch grid in the same ratio, and its pinpoints multiples of the tiny tile (its default's are not)."""
    full = tf.Granite4VisionConfig(deepstack_layer_map=[[-19, 9], [-13, 6], [-7, 3], [-1, 0]], downsample_rate="4/8")
    granite = tiny_copy_config(full)
    vision, text = granite.vision_config, granite.text_config
    assert all(
        -vision.num_hidden_layers - 1 <= v < 0 <= t < text.num_hidden_layers for v, t in granite.deepstack_layer_map
    )
    assert all(0 <= t < text.num_hidden_layers for t in granite.spatial_target_layers)
    assert granite.qformer_config.num_attention_heads == 2 == vision.hidden_size // 64
    query, window = map(int, granite.downsample_rate.split("/"))
    assert query * 2 == window and (vision.image_size // vision.patch_size) % window == 0
    assert all(side % vision.image_size == 0 for pinpoint in granite.image_grid_pinpoints for side in pinpoint)
