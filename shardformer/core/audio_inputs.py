"""Random audio inputs for checking a speech model: a waveform (``input_values``) long enough for its
convolutional feature encoder, or log-mel features (``input_features``) as wide as its config says,
and a CTC head's transcripts that fit the frames."""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn as nn
from transformers.models.auto.feature_extraction_auto import (
    FEATURE_EXTRACTOR_MAPPING_NAMES,
    feature_extractor_class_from_name,
)

FRAMES = 8  # frames the feature encoder leaves of a waveform: a few, as tokens are for text
SAMPLES = 4000  # a quarter second at 16 kHz: a waveform for an encoder whose strides the config does not name
_SUB_CONFIGS = ("encoder_config", "audio_config", "speech_config", "encoder")  # where a speech tower's sizes live


def audio_inputs(model, config, main: str, batch: int, g: torch.Generator) -> dict:
    """``{main: ...}`` for a model whose main input is ``input_values`` or ``input_features``."""
    audio = _audio_config(config)
    if main == "input_values" and _conv_layers(audio):  # wav2vec2 and its kin: a raw waveform
        channels = (1,) if _waveform_has_channels(getattr(config, "model_type", None)) else ()
        return {"input_values": torch.randn(batch, *channels, waveform_length(audio), generator=g)}
    if main == "input_values" and _width(audio) is None:  # a feature encoder its config does not size (Moonshine)
        return {"input_values": torch.randn(batch, SAMPLES, generator=g)}
    features = _features(config, audio, batch, g)
    first = next((m for m in model.modules() if next(m.parameters(recurse=False), None) is not None), None)
    width = features.shape[-1]
    if isinstance(first, nn.Linear) and first.in_features != width and first.in_features % width == 0:
        # frames stacked as the feature extractor stacks them (Granite Speech: mel bins delta-expanded, then paired)
        features = torch.randn(*features.shape[:-1], first.in_features, generator=g)
    return {main: features}


@functools.cache
def _waveform_has_channels(model_type: str | None) -> bool:
    """Whether the model type's feature extractor gives a waveform as ``[batch, 1, samples]`` (OmniASR's),
    not ``[batch, samples]`` (wav2vec2's): its output for one silent clip, as a user's processor makes it."""
    name = FEATURE_EXTRACTOR_MAPPING_NAMES.get(model_type)
    try:
        extractor = feature_extractor_class_from_name(name)()
        clip = extractor(
            np.zeros(SAMPLES, dtype=np.float32), sampling_rate=extractor.sampling_rate, return_tensors="pt"
        )
    except Exception:  # noqa: BLE001 - no extractor, or one that wants more: the plain layout
        return False
    return clip.get("input_values") is not None and clip["input_values"].dim() == 3


def streamed_audio(config, params, tokens: tuple[int, int], g: torch.Generator) -> dict:
    """Log-mel frames beside the token ids of a model that adds its audio to every token's embedding
    (Voxtral Realtime: ``audio_length_per_tok`` frames a token, ``[batch, mel bins, frames]``), else nothing."""
    per_token = getattr(config, "audio_length_per_tok", None)
    if "input_features" not in params or not isinstance(per_token, int):
        return {}
    bins = _audio_config(config).num_mel_bins
    return {"input_features": torch.randn(tokens[0], bins, per_token * tokens[1], generator=g)}


def ctc_labels(config, batch: int, g: torch.Generator) -> torch.Tensor:
    """A CTC head's transcripts: half as many tokens as the waveform's frames (room for the blanks
    between repeats), none of them the blank (the pad token)."""
    vocab, blank = config.vocab_size, getattr(config, "pad_token_id", None) or 0
    labels = torch.randint(0, vocab, (batch, FRAMES // 2), generator=g)
    return labels.masked_fill(labels == blank, (blank + 1) % vocab)


def waveform_length(config, frames: int = FRAMES) -> int:
    """The fewest samples from which the config's feature encoder (``conv_kernel`` / ``conv_stride``, then
    its adapter's strided layers) leaves ``frames`` frames: each convolution run backwards."""
    length = frames
    if getattr(config, "add_adapter", False):  # the adapter's convolutions (padding 1) after the encoder
        kernel, stride = config.adapter_kernel_size, config.adapter_stride
        for _ in range(config.num_adapter_layers):
            length = (length - 1) * stride + kernel - 2
    for kernel, stride in reversed(_conv_layers(config)):
        length = (length - 1) * stride + kernel
    return length


def _conv_layers(config) -> list[tuple[int, int]]:
    """``(kernel, stride)`` of each layer of the config's convolutional feature encoder (none when it
    names none)."""
    kernels, strides = getattr(config, "conv_kernel", None), getattr(config, "conv_stride", None)
    if not isinstance(kernels, (list, tuple)) or not isinstance(strides, (list, tuple)):
        return []
    return list(zip(kernels, strides))


def _features(config, audio, batch: int, g: torch.Generator) -> torch.Tensor:
    """Random log-mel features: ``[batch, mel bins, frames]`` where the model's own config names
    ``num_mel_bins`` (Whisper: the bins are its first convolution's channels, twice as many frames as
    encoder positions, as its stride-2 convolution needs); else ``[batch, frames, width]`` from ``audio``,
    its speech tower's config (Speech2Text, SeamlessM4T, wav2vec2-BERT, the FastConformers of Parakeet
    and Canary, AST's spectrogram of ``max_length`` frames: frames first)."""
    positions = getattr(audio, "max_source_positions", None) or getattr(audio, "max_length", None) or 32
    names = config.to_dict()
    if "num_mel_bins" in names and "max_length" not in names:
        return torch.randn(batch, config.num_mel_bins, 2 * positions, generator=g)
    width = _width(audio)
    if width is None:
        raise AttributeError(f"{type(audio).__name__} names no width of its input features")
    return torch.randn(batch, positions, width, generator=g)


def _width(config) -> int | None:
    """The width of one frame of features, as the config names it (None: it names none)."""
    per_channel = getattr(config, "input_feat_per_channel", None)
    if per_channel:  # Speech2Text: channels of features side by side
        return per_channel * getattr(config, "input_channels", 1)
    for key in ("num_mel_bins", "feature_projection_input_dim", "feature_size", "input_dim"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    return None


def _audio_config(config):
    """The config that holds the speech tower's sizes: ``config`` itself, or its encoder's / audio tower's."""
    if _conv_layers(config) or _width(config) is not None:
        return config
    subs = (getattr(config, key, None) for key in _SUB_CONFIGS)
    return next((sub for sub in subs if hasattr(sub, "to_dict")), config)
