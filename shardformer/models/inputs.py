"""Random inputs for checking a model (``shardformer verify``, the tests): the default ``inputs`` of a
family record, and what models without a record get."""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

SEQ = 8  # tokens per sequence


def make_inputs(model: nn.Module, seed: int, batch: int = 2) -> dict:
    """Random inputs for the model's main input (token ids, images, audio features; both towers of a
    two-tower model; decoder ids of an encoder-decoder), with labels where the head's name says what they are."""
    g = torch.Generator().manual_seed(seed)
    config = getattr(model, "config", None)
    name = type(model).__name__
    main = getattr(model, "main_input_name", "input_ids")
    if main == "pixel_values" or not hasattr(model, "config"):
        x = _images(model, getattr(config, "vision_config", config), batch, g)
        x = x if config is not None else {"x": x["pixel_values"]}  # timm: positional
        if name.endswith("ForImageClassification"):
            x["labels"] = torch.randint(0, config.num_labels, (batch,), generator=g)
        return x
    if main == "input_features":  # speech: log-mel frames, twice the encoder's positions (a stride-2 conv)
        frames = 2 * getattr(config, "max_source_positions", SEQ)
        x = {"input_features": torch.randn(batch, config.num_mel_bins, frames, generator=g)}
    else:
        x = {"input_ids": torch.randint(0, _vocab(model, config), (batch, SEQ), generator=g)}
    if "pixel_values" in inspect.signature(model.forward).parameters and "input_ids" in x:  # two towers (CLIP)
        x.update(_images(model, getattr(config, "vision_config", config), batch, g))
    ids = x.get("input_ids")
    if ids is not None and "pixel_values" in x:
        ids = x["input_ids"] = _with_image_tokens(model, config, ids, x["pixel_values"])
    text_vocab = _vocab(model, config)
    eos = getattr(config, "eos_token_id", None)
    if ids is not None and getattr(config, "is_encoder_decoder", False) and isinstance(eos, int):
        ids[:, -1] = eos  # encoder-decoder classifiers pool at the end-of-sequence token
    if getattr(config, "is_encoder_decoder", False):
        targets = torch.randint(3, text_vocab, (batch, SEQ), generator=g)
        x["labels" if name.endswith("ForConditionalGeneration") else "decoder_input_ids"] = targets
    elif name.endswith(("ForCausalLM", "LMHeadModel", "ForMaskedLM")):
        x["labels"] = ids.clone()
    elif name.endswith("ForSequenceClassification"):
        x["labels"] = torch.randint(0, config.num_labels, (batch,), generator=g)
    elif name.endswith("ForTokenClassification"):
        x["labels"] = torch.randint(0, config.num_labels, (batch, SEQ), generator=g)
    return x


def _vocab(model: nn.Module, config) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "vocab_size", None) or model.get_input_embeddings().num_embeddings


def _images(model: nn.Module, config, batch: int, g: torch.Generator) -> dict:
    size = getattr(config, "image_size", None) or getattr(getattr(model, "patch_embed", None), "img_size", (224,))
    size = size[0] if isinstance(size, (tuple, list)) else size
    channels = getattr(config, "num_channels", None) or getattr(model, "in_chans", 3)
    return {"pixel_values": torch.randn(batch, channels, size, size, generator=g)}


def _with_image_tokens(model: nn.Module, config, ids: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
    """Token ids of an image-text model with its image placeholder token once per image feature
    (LLaVA, Gemma 3, PaliGemma: as many as ``get_image_features`` gives for one image) before the text."""
    token = getattr(config, "image_token_id", None)
    token = getattr(config, "image_token_index", None) if token is None else token
    if not isinstance(token, int) or not hasattr(model, "get_image_features"):
        return ids
    try:
        with torch.no_grad():
            out = model.get_image_features(pixel_values=pixels[:1])
    except Exception:  # noqa: BLE001 - a model wanting more than pixels (grids, sizes): text only
        return ids
    features = getattr(out, "pooler_output", None)
    features = out if features is None else features
    first = features[0] if isinstance(features, (list, tuple)) else features
    if not torch.is_tensor(first) or first.dim() < 2:
        return ids
    count = first.numel() // first.shape[-1]
    text = ids.masked_fill(ids == token, 3 if token != 3 else 4)
    return torch.cat([torch.full((ids.shape[0], count), token, dtype=ids.dtype), text], dim=1)
