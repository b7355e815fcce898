"""Random inputs for checking a model (``shardformer verify``, the tests): a family record's, or the recipe's."""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from shardformer.core import example_inputs
from shardformer.core.audio_inputs import audio_inputs, ctc_labels, streamed_audio
from shardformer.core.grid_inputs import FRAMED_PATCHES, framed_patches, grid_images, pooled_patches
from shardformer.core.image_sizes import sized_images, takes_sizes, tiled_images
from shardformer.core.refusal import POLICY, Refusal
from shardformer.core.side_inputs import side_inputs
from shardformer.core.tiny import VOCAB
from shardformer.core.tiny_sequence import SEQ

# model type -> the config value its processor pads every text to (Perceiver's masked-LM decoder has one
# query per position, so its logits and labels meet only at that length)
PADDED_TO = {"perceiver": "max_position_embeddings"}
TILED = {"perception_lm"}  # models whose processor cuts each image into tiles, which their forward flattens
VQ_SIDE = 32  # a VQ-VAE's images where its config names no size (Emu3's): a few codes each, as many as it downsamples
# model type -> frames per video its processor samples, where the forward takes videos as ``pixel_values``
VIDEO_FRAMES = {"instructblipvideo": 4}
# model types whose pixel_attention_mask keeps whole pictures, [batch, pictures] (GraniteDocling's tiles, PI0's
# cameras), and which require it
PICTURE_MASKS = {"granite_docling", "pi0"}


def make_inputs(model: nn.Module, seed: int, batch: int = 2) -> dict:
    """Random inputs for the model's main input (token ids, images, audio features; both towers of a
    two-tower model; decoder ids of an encoder-decoder), with labels where the head's name says what they are;
    the user's ``example_inputs`` where the model carries them (`shardformer.core.example_inputs`)."""
    given = example_inputs.given_inputs(model, batch)
    if given is not None:
        return given
    g = torch.Generator().manual_seed(seed)
    config = getattr(model, "config", None)
    name = type(model).__name__
    main = getattr(model, "main_input_name", "input_ids")
    params = inspect.signature(model.forward).parameters
    encoder_main = getattr(getattr(model, "encoder", None), "main_input_name", None)
    if main == "inputs" and encoder_main in params:  # SpeechEncoderDecoder: what its encoder reads
        main = encoder_main
    if main == "inputs" and "pixel_values" in params and "input_ids" not in params:  # Perceiver's image heads
        main = "pixel_values"
    if config is None and not _is_timm(model):
        return _plain_inputs(model, params, batch, g)
    if main == "pixel_values" and "input_ids" not in params or not hasattr(model, "config"):
        x = _images(model, config, batch, g)
        x = x if config is not None else {"x": x["pixel_values"]}  # timm: positional
        if name.endswith("ForImageClassification"):
            x["labels"] = torch.randint(0, config.num_labels, (batch,), generator=g)
        if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:  # an image captioner
            x["decoder_input_ids"] = torch.randint(3, _vocab(model, config), (batch, SEQ), generator=g)
        return x
    if main == "flattened_patches":  # Pix2Struct: each patch's row and column, then its pixels
        x = _flattened_patches(config.vision_config, batch, g)
    elif main in ("input_values", "input_features"):  # speech: a waveform or log-mel features
        x = audio_inputs(model, config, main, batch, g)
    elif main == "inputs" and "input_ids" not in params:  # Perceiver without a preprocessor: features
        x = {"inputs": torch.randn(batch, SEQ, config.d_model, generator=g)}
    elif _generates_from_features(model, params):  # Pop2Piano: its feature extractor's features, embedded no
        x = {"input_features": torch.randn(batch, SEQ, config.d_model, generator=g)}  # further; generate reads no ids
    else:
        length = getattr(config, PADDED_TO.get(getattr(config, "model_type", None), ""), SEQ)
        x = {"input_ids": _text(torch.randint(0, _vocab(model, config), (batch, length), generator=g), config)}
    codes = getattr(config, "codebook_vocab_size", None)
    if "input_ids" in x and isinstance(codes, int) and not getattr(config, "is_encoder_decoder", False):
        # Kyutai's decoder sums a text token and one code per codebook at each step: [batch, seq, 1 + codebooks]
        steps = torch.randint(0, codes, (batch, SEQ, config.num_codebooks), generator=g)
        x["input_ids"] = torch.cat([x["input_ids"][..., None], steps], dim=-1)
    if "input_ids" in x and x["input_ids"].dim() == 2:
        x.update(side_inputs(config, params, tuple(x["input_ids"].shape), g))
        x.update(streamed_audio(config, params, tuple(x["input_ids"].shape), g))
    videos = params.get("pixel_values_videos")
    if videos is not None and videos.default is videos.empty:  # a video-text model (VideoPrism): its clips
        frames = image_config(config).num_frames
        x["pixel_values_videos"] = _images(model, config, batch, g, frames)["pixel_values"]
    qformer = getattr(config, "qformer_config", None)
    if "qformer_input_ids" in params and qformer is not None:  # InstructBLIP's instruction to its Q-Former
        x["qformer_input_ids"] = torch.randint(3, qformer.vocab_size, (batch, SEQ), generator=g)
    no_tower = "vision_config" in getattr(config, "__dict__", {}) and config.vision_config is None
    if "pixel_values" in params and "input_ids" in x and not no_tower:  # two towers (CLIP), an image-text model
        x.update(_images(model, config, batch, g))
        x["input_ids"] = _with_image_tokens(model, config, x["input_ids"], x.get("qformer_input_ids"))
        image = _special_tokens(config).get("image_token_id")
        if "mm_token_type_ids" in params and image is not None:  # image features (Qwen2-VL's multimodal rotary)
            x["mm_token_type_ids"] = (x["input_ids"] == image).int()
        if "aspect_ratio_ids" in params:  # Mllama: one image per sample, cut into tiles, cross-attended
            x.update(tiled_images(image_config(config), x["pixel_values"], x["input_ids"].shape))
        queries = getattr(config, "latent_query_num", None)
        if "image_embeds_position_mask" in params and isinstance(queries, int):  # Kosmos-2: image slots, then text
            ids = x["input_ids"]
            x["input_ids"] = torch.cat([ids[:, :1].expand(-1, queries), ids], dim=1)
            x["image_embeds_position_mask"] = (
                (torch.arange(x["input_ids"].shape[1]) < queries).long().expand_as(x["input_ids"])
            )
        if "image_attention_mask" in params:  # Idefics: images per sample, each text token sees them all
            x["pixel_values"] = x["pixel_values"][:, None]
            x["image_attention_mask"] = torch.ones(*x["input_ids"].shape, 1, dtype=torch.long)
    ids = x.get("input_ids")
    eos = getattr(config, "eos_token_id", None)
    if ids is not None and getattr(config, "is_encoder_decoder", False) and isinstance(eos, int):
        ids.masked_fill_(ids == eos, 3 if eos != 3 else 4)  # encoder-decoder classifiers pool at the one
        ids[:, -1] = eos  # end-of-sequence token each sample must hold
    sep = getattr(config, "sep_token_id", None)
    if ids is not None and name.endswith("ForQuestionAnswering") and isinstance(sep, int) and ids.shape[1] > 4:
        ids.masked_fill_(ids == sep, 3 if sep != 3 else 4)  # a question, then its context, as a tokenizer
        ids[:, [2, 3, -1]] = sep  # pairs them (q </s></s> c </s>): Longformer counts the three separators
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:  # not an encoder's head
        books = getattr(getattr(config, "decoder_config", None), "num_channels", 1)  # Dia's decoder: a code per channel
        targets = torch.randint(3, _vocab(model, config), (batch * books, SEQ), generator=g)
        x["labels" if name.endswith("ForConditionalGeneration") else "decoder_input_ids"] = targets
        if books > 1:  # it starts from one bos per channel, not from the labels: ids per step and channel, the
            x["decoder_input_ids"] = targets.view(batch, books, SEQ).transpose(1, 2).contiguous()  # 3-d form it reads
    elif name.endswith("ForCausalLM") and _codebooks(model, config):  # MusicGen's decoder: ids per codebook
        books = _codebooks(model, config)
        x["input_ids"] = torch.randint(3, _vocab(model, config), (batch * books, SEQ), generator=g)
        x["labels"] = x["input_ids"].reshape(batch, books, SEQ).transpose(1, 2).clone()
    elif name.endswith(("ForCausalLM", "LMHeadModel", "ForMaskedLM")):
        x["labels"] = ids.clone()
    elif name.endswith(("ForSequenceClassification", "ForAudioClassification")):
        x["labels"] = torch.randint(0, config.num_labels, (batch,), generator=g)
    elif name.endswith("ForCTC"):
        x["labels"] = ctc_labels(config, batch, g)
        mask = next((m for m in ("attention_mask", "padding_mask") if m in params), None)
        if mask is not None:  # the CTC loss reads the input lengths from it (Parakeet; OmniASR's over its samples)
            audio = x[main]
            x[mask] = torch.ones(audio.shape[0], audio.shape[-1 if main == "input_values" else 1], dtype=torch.long)
    elif name.endswith("ForTokenClassification"):
        x["labels"] = torch.randint(0, config.num_labels, ids.shape if ids is not None else (batch, SEQ), generator=g)
    elif name.endswith("ForMultipleChoice") and ids is not None:  # [batch, choices, seq]: two choices
        x["input_ids"] = torch.stack([ids, ids.roll(1, dims=-1)], dim=1)
        x["labels"] = torch.randint(0, 2, (batch,), generator=g)
    if "state" in params and "use_cache" in params:  # RWKV caches by default in eval mode, writing its recurrent
        x["use_cache"] = False  # state in place layer by layer (no backward through it); training caches nothing
    return x


def _is_timm(model: nn.Module) -> bool:
    return type(model).__module__.startswith("timm.")


class NoInputsError(Refusal):
    """The recipe cannot make inputs for a model: its copy cannot be run, so no cut can be derived or proven."""


def _plain_inputs(model: nn.Module, params, batch: int, g: torch.Generator) -> dict:
    """A plain module's inputs, as its forward's first parameter: token ids when it embeds tokens (ids below
    every ``nn.Embedding``'s size, so any of them may read them), else float features when its first weights
    are a Linear's or a convolution's (`shardformer.core.example_inputs.inferred_features`); every other
    parameter must have a default. Else refused, naming ``example_inputs``."""
    name = type(model).__name__
    first = next(iter(params), None)
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    features = None if sizes else example_inputs.inferred_features(model, batch, SEQ, g)
    if first is None or not sizes and features is None:
        raise NoInputsError(
            f"shardformer cannot make inputs for {name} (a plain module: no transformers config, not a timm "
            f"model, no nn.Embedding to give token ids and no first Linear or convolution to give features as its "
            f"first forward argument{f' {first!r}' if first else ''}), so no copy of it can be run to derive or "
            f"prove a cut",
            example_inputs.pass_them([first or "x"]),
            POLICY,
        )
    required = [
        p.name
        for p in list(params.values())[1:]
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if required:
        named = ", ".join(repr(r) for r in required)
        example = ", ".join(f"{r}=None" for r in required)
        raise NoInputsError(
            f"shardformer cannot make inputs for {name}: the derived route runs a copy of it (two blocks per "
            f"stack) to find and prove its cut, and the recipe gives a plain module only its first argument "
            f"{first!r}; {name}.forward requires {named} as well",
            example_inputs.pass_them([first, *required]),
            f"give {name}.forward's {named} a default (def forward(self, {first}, {example})) with which it runs "
            f"on its first argument alone",
            POLICY,
        )
    if features is not None:
        return {first: features}
    return {first: torch.randint(0, min(sizes), (batch, SEQ), generator=g)}


def _generates_from_features(model: nn.Module, params) -> bool:
    """Whether the model's generate requires ``input_features`` (first, no default) that its forward takes too."""
    generate = getattr(model, "generate", None)
    first = next(iter(inspect.signature(generate).parameters.values()), None) if callable(generate) else None
    required = first is not None and first.default is first.empty
    return required and first.name == "input_features" and first.name in params


def _codebooks(model: nn.Module, config) -> int:
    """The codebooks a decoder embeds one table each of (MusicGen: ids ``[batch * codebooks, seq]``), or 0."""
    books = getattr(config, "num_codebooks", None)
    if not isinstance(books, int) or getattr(config, "is_encoder_decoder", False):
        return 0
    tables = (m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == books)
    return books if any(all(isinstance(t, nn.Embedding) for t in m) for m in tables) else 0


def _vocab(model: nn.Module, config) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "vocab_size", None):
        return text.vocab_size
    try:
        return model.get_input_embeddings().num_embeddings
    except NotImplementedError:  # no table of tokens: Canine hashes any code point into its buckets
        return VOCAB


def _images(model: nn.Module, config, batch: int, g: torch.Generator, frames: int | None = None) -> dict:
    """Random images as the model takes them: a batch of pictures; one picture per sample (Idefics2/3,
    SmolVLM: their ``pixel_attention_mask``); ``frames`` pictures per sample (a video: ``VIDEO_FRAMES``);
    or patches with their grid (Qwen2-VL: ``image_grid_thw``, a 2×2 grid of merged patches per image)."""
    vision = image_config(config)
    size = getattr(vision, "image_size", None) or getattr(getattr(model, "patch_embed", None), "img_size", None)
    size = size or (getattr(vision, "model_args", None) or {}).get("img_size")  # a timm tower's, as the config sets it
    # a VQ-VAE tokenizing the images (Chameleon's, Apertus 1.5's): the resolution it was built for
    size = (
        size or getattr(vision, "resolution", None) or (VQ_SIDE if vision is getattr(config, "vq_config", 0) else None)
    )
    # a timm model without a patch embedding (HaloNet: 256 x 256 only): the size it was built for
    size = size or (getattr(model, "pretrained_cfg", None) or {}).get("input_size", (3, 224))[1:] or (224,)
    size = size[0] if isinstance(size, (tuple, list)) else size
    channels = getattr(vision, "num_channels", None) or getattr(vision, "in_channels", None)
    channels = channels or getattr(model, "in_chans", 3)
    params = inspect.signature(model.forward).parameters
    grids = [k for k in ("image_grid_thw", "image_grid_hw") if k in params]  # NemotronH Omni's: no time axis
    if "image_token_pooling" in params:  # Molmo2: flattened patches pooled into tokens by an index table
        return pooled_patches(vision, channels, batch, g)
    if getattr(vision, "model_type", None) in FRAMED_PATCHES:
        return framed_patches(vision, channels, batch, g)
    if grids:
        return grid_images(vision, getattr(config, "model_type", None), params, grids[0], channels, batch, g)
    if "image_sizes" in params and (getattr(config, "image_grid_pinpoints", None) or takes_sizes(model, vision)):
        return sized_images(config, channels, size, batch, g)
    if "spatial_shapes" in params and isinstance(getattr(vision, "num_patches", None), int):
        return _patchified_images(vision, channels, batch, g, vision.num_patches)
    if isinstance(getattr(config, "patch_dim", None), int) and getattr(vision, "image_size", None) is None:
        # NeoMME: flattened patches as wide as its config says, no image size (RADIO has one: it cuts its images)
        return {"pixel_values": torch.randn(batch * 16, config.patch_dim, generator=g)}
    if "image_patches" in params:  # Fuyu: a linear embedding of flattened patches, no vision tower
        patches = _patchified_images(vision, channels, batch, g, (size // vision.patch_size) ** 2)
        return {"pixel_values": patches["pixel_values"]}
    frames = frames or VIDEO_FRAMES.get(getattr(config, "model_type", None))
    if frames:
        return {"pixel_values": torch.randn(batch, frames, channels, size, size, generator=g)}
    pixels = {"pixel_values": torch.randn(batch, channels, size, size, generator=g)}
    high = getattr(config, "high_res_vision_config", None)
    if "high_res_pixel_values" in params and high is not None:  # DeepSeek-VL hybrid: the picture at two sizes
        pixels["high_res_pixel_values"] = torch.randn(batch, channels, high.image_size, high.image_size, generator=g)
    if getattr(config, "model_type", None) in TILED:  # one tile per sample: [batch, tiles, channels, side, side]
        pixels["pixel_values"] = pixels["pixel_values"][:, None]
    if "pixel_attention_mask" in params:  # one picture per sample (Idefics2/3: its pixels' mask left to the model)
        pixels["pixel_values"] = pixels["pixel_values"][:, None]
        if getattr(config, "model_type", None) in PICTURE_MASKS:
            pixels["pixel_attention_mask"] = torch.ones(batch, 1, dtype=torch.bool)
    return pixels


def image_config(config):
    """The config that sizes the images: the vision tower's (or VQ-VAE's), also inside an encoder (T5Gemma 2) or a
    vision-language model (PI0's ``vlm_config``), or the encoder itself (VisionEncoderDecoder), else the
    model's own."""
    encoder = getattr(config, "encoder", None)
    inner = (getattr(getattr(config, key, None), "vision_config", None) for key in ("encoder", "vlm_config"))
    for found in (getattr(config, "vision_config", None), getattr(config, "vq_config", None), *inner):
        if found is not None:
            return found
    return encoder if hasattr(encoder, "image_size") else config


def _patchified_images(vision, channels: int, batch: int, g: torch.Generator, patches: int) -> dict:
    """Images already cut into flattened patches (SigLIP 2's NaFlex processor, Fuyu's): a square grid of
    at most ``patches`` patches, each ``channels x patch x patch`` values, with the grid's ``spatial_shapes``
    and a mask that keeps every patch."""
    side = int(patches**0.5)
    patch = channels * vision.patch_size * vision.patch_size
    return {
        "pixel_values": torch.randn(batch, side * side, patch, generator=g),
        "pixel_attention_mask": torch.ones(batch, side * side, dtype=torch.long),
        "spatial_shapes": torch.tensor([[side, side]] * batch),
    }


def _flattened_patches(vision, batch: int, g: torch.Generator, side: int = 4) -> dict:
    """Pix2Struct's input: a ``side x side`` grid of patches, each its 1-based row and column then
    ``patch_embed_hidden_size`` pixel values, with a mask that keeps them all."""
    grid = torch.arange(side * side)
    places = torch.stack([grid // side + 1, grid % side + 1], dim=-1).float().expand(batch, -1, -1)
    pixels = torch.randn(batch, side * side, vision.patch_embed_hidden_size, generator=g)
    return {"flattened_patches": torch.cat([places, pixels], dim=-1), "attention_mask": torch.ones(batch, side * side)}


def _special_tokens(config) -> dict[str, int]:
    """The config's special token ids other than bos/eos/pad (an image placeholder, a vision start)."""
    found = {}
    for key in {*dir(config), *getattr(config, "attribute_map", {})}:  # Molmo2's image_token_id: its image_patch_id
        if key.endswith(("_token_id", "_token_index")) and not key.startswith(("_", "bos", "eos", "pad")):
            value = getattr(config, key, None)
            if isinstance(value, int) and not isinstance(value, bool):
                found[key] = value
    return found


def _text(ids: torch.Tensor, config) -> torch.Tensor:
    """Random text without the special tokens (a stray image placeholder or vision start would ask for
    images the inputs do not hold)."""
    for token in set(_special_tokens(config).values()) if config is not None else ():
        ids = ids.masked_fill(ids == token, 3 if token != 3 else 4)
    return ids


def _with_image_tokens(model: nn.Module, config, ids: torch.Tensor, qformer_ids=None) -> torch.Tensor:
    """Token ids of an image-text model with its image placeholder token once per image feature
    (as many as ``get_image_features`` gives for one image) before the text, between the vision
    start and end tokens where the model has them (Qwen2-VL). ``qformer_ids``: InstructBLIP's
    instruction, which its image features depend on."""
    special = _special_tokens(config)
    names = ("image_token_id", "image_token_index", "video_token_index")
    name = next((n for n in names if n in special), None)
    # InstructBLIP-Video's video token stands for its get_video_features
    features_of = "get_video_features" if name == "video_token_index" else "get_image_features"
    # a head over a multimodal base model (Gemma 3's classifier) leaves get_image_features to its base
    tower = next((m for m in model.modules() if hasattr(m, features_of)), None)
    if name is None or tower is None:
        return ids
    token = special[name]
    images = _images(model, config, 1, torch.Generator().manual_seed(0))
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)  # float64 reruns
    one = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in images.items()}
    if qformer_ids is not None:
        one["qformer_input_ids"] = qformer_ids[:1]
    try:
        with torch.no_grad():
            out = getattr(tower, features_of)(**one)
    except Exception:  # noqa: BLE001 - a model wanting more than the recipe gives: text only
        return ids
    features = getattr(out, "pooler_output", None)  # the features the model places, by transformers' convention
    deep = getattr(out, "deepstack_features", None)  # else Granite 4 Vision's: (decoder layer, features per image)
    features = deep[0][1] if features is None and isinstance(deep, list) and deep else features
    features = getattr(out, "last_hidden_state", out) if features is None else features  # Fuyu: no pooling
    first = features[0] if isinstance(features, (list, tuple)) else features
    if not torch.is_tensor(first) or first.dim() < 2:
        return ids
    count = first.numel() // first.shape[-1] * (len(features) if isinstance(features, (list, tuple)) else 1)
    span = [special.get("vision_start_token_id"), *[token] * count, special.get("vision_end_token_id")]
    span = torch.tensor([t for t in span if t is not None], dtype=ids.dtype)
    return torch.cat([span.expand(ids.shape[0], -1), ids], dim=1)
