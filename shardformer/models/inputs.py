"""Random inputs for checking a model (``shardformer verify``, the tests): the default ``inputs`` of a
family record, and what models without a record get."""

from __future__ import annotations

import torch
import torch.nn as nn

SEQ = 8  # tokens per sequence


def make_inputs(model: nn.Module, seed: int, batch: int = 2) -> dict:
    """Random inputs for the model's main input, with labels where the head's name says what they are."""
    g = torch.Generator().manual_seed(seed)
    config = getattr(model, "config", None)
    name = type(model).__name__
    if getattr(model, "main_input_name", "input_ids") == "pixel_values" or not hasattr(model, "config"):
        size = getattr(config, "image_size", None) or getattr(getattr(model, "patch_embed", None), "img_size", (224,))
        size = size[0] if isinstance(size, (tuple, list)) else size
        channels = getattr(config, "num_channels", None) or getattr(model, "in_chans", 3)
        images = torch.randn(batch, channels, size, size, generator=g)
        x = {"pixel_values": images} if config is not None else {"x": images}  # timm: positional
        if name.endswith("ForImageClassification"):
            x["labels"] = torch.randint(0, config.num_labels, (batch,), generator=g)
        return x
    vocab = getattr(config, "vocab_size", None) or model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (batch, SEQ), generator=g)
    x = {"input_ids": ids}
    if name.endswith(("ForCausalLM", "LMHeadModel", "ForMaskedLM")):
        x["labels"] = ids.clone()
    elif name.endswith("ForSequenceClassification"):
        x["labels"] = torch.randint(0, config.num_labels, (batch,), generator=g)
    elif name.endswith("ForTokenClassification"):
        x["labels"] = torch.randint(0, config.num_labels, (batch, SEQ), generator=g)
    return x
