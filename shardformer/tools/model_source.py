"""What a user names on the command line (or in Python) becomes a model or a policy.

A model: a factory (callable), ``module:function``, ``timm:<name>``, a folder with config.json
(``model_class`` names the transformers class when its config has no ``architectures``), a tiny
model per built-in family (``gpt2-tiny``, ...) or a full-size built-in name (``gpt2``, ``llama-7b``,
...). ``shardformer plan`` builds it on the meta device, ``shardformer verify`` with real weights.
A policy: None (the model's own), a Policy instance or class, or ``module:Class``.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Any

import torch.nn as nn
import transformers as tf

from shardformer.models import builds, tiny_models
from shardformer.tools.model_names import close_matches, resolve_name

# Full-size models whose policies come from transformers' own plans (transformers' default configs of
# these are the published sizes); the hand-written families name their own builds in their records.
PLAN_DERIVED = {
    "llama-7b": lambda: tf.LlamaForCausalLM(tf.LlamaConfig()),
    "phi3-mini": lambda: tf.Phi3ForCausalLM(tf.Phi3Config()),
    "mixtral-8x7b": lambda: tf.MixtralForCausalLM(tf.MixtralConfig()),
    # published sizes of larger models, for `shardformer plan --simulate` (configs only, no weights)
    "llama3-8b": lambda: tf.LlamaForCausalLM(_llama3(4096, 32, 32, 14336)),
    "llama3-70b": lambda: tf.LlamaForCausalLM(_llama3(8192, 80, 64, 28672)),
    "llama3-405b": lambda: tf.LlamaForCausalLM(_llama3(16384, 126, 128, 53248)),
    "mixtral-8x22b": lambda: tf.MixtralForCausalLM(
        tf.MixtralConfig(
            hidden_size=6144,
            num_hidden_layers=56,
            num_attention_heads=48,
            num_key_value_heads=8,
            intermediate_size=16384,
            vocab_size=32768,
            num_local_experts=8,
            num_experts_per_tok=2,
        )
    ),  # fmt: skip
    "deepseek-v3": lambda: tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config()),  # transformers' default is V3's size
}


def _llama3(hidden: int, layers: int, heads: int, ffn: int):
    return tf.LlamaConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8,
        intermediate_size=ffn, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False,
    )  # fmt: skip


_HINT_MAPPINGS = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_MAPPING_NAMES",
)


def class_hint(config) -> str:
    """A transformers class that exists for ``config``'s model type (its causal LM, masked LM, image
    classifier or base model, as transformers' auto classes map it), for error messages."""
    from transformers.models.auto import modeling_auto

    for mapping in _HINT_MAPPINGS:
        name = getattr(modeling_auto, mapping, {}).get(getattr(config, "model_type", None))
        if isinstance(name, str) and isinstance(getattr(tf, name, None), type):
            return name
    return "LlamaForCausalLM"


def model_class_for(config, folder: str, model_class: str | None = None) -> type:
    """The transformers class named by ``model_class``, else by the config's ``architectures``."""
    names = [model_class] if model_class else (getattr(config, "architectures", None) or [])
    if not names:
        raise ValueError(
            f"{folder}/config.json has no 'architectures'; name the model class with --model-class "
            f"(e.g. {class_hint(config)})"
        )
    cls = getattr(tf, names[0], None)
    if not isinstance(cls, type):
        source = "--model-class" if model_class else f"{folder}/config.json 'architectures'"
        raise ValueError(f"{names[0]!r} (from {source}) is not a transformers model class (e.g. {class_hint(config)})")
    return cls


TINY_MODELS = tiny_models()  # one tiny model per model family


def _import(spec: str, what: str):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{what} {spec!r} must be module:name (e.g. my_models:build)")
    try:
        obj = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} {spec!r}: cannot import it ({e}); is its folder on PYTHONPATH?") from e
    return obj


def build_model(model: Any, model_class: str | None = None, weights: bool = True) -> nn.Module:
    """A model from: a factory (callable), ``timm:<name>``, a folder with config.json (weights loaded if
    present; ``model_class`` names the transformers class when config.json has no ``architectures``),
    a ``module:function`` factory, or a built-in name (``gpt2-tiny``, ``bert-tiny``, ...; ``gpt2``, ...)."""
    if isinstance(model, nn.Module):
        raise TypeError("pass a factory or a name, not a model: every process builds its own copy")
    if callable(model):
        return model()
    if model.startswith("timm:"):
        import timm  # deferred: importing timm registers every timm model; only when asked for

        return timm.create_model(_timm_name(model), pretrained=False)
    if os.path.isdir(model):
        return _from_folder(model, model_class, weights)
    if ":" in model:
        return _import(model, "MODEL")()
    cached = hub_cache_folder(model)
    if cached is not None:
        return _from_folder(cached, model_class, weights)
    named = {**builds(), **PLAN_DERIVED}
    return named[resolve_model_name(model, named)]()


def resolve_model_name(model: str, named) -> str:
    """The built-in name ``model`` spells (``llama-70b``, ``Llama-3.1-70B``, ``meta-llama/Meta-Llama-3-70B``:
    ``llama3-70b``), or a ValueError listing the close matches and every known name."""
    name = resolve_name(model, named)
    if name is not None:
        return name
    close = close_matches(model, named)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    raise ValueError(
        f"MODEL {model!r} is not a folder with config.json, module:function, timm:<name> or a built-in name; "
        f"{hint}known names: {', '.join(sorted(named))} (the list: shardformer plan --help)"
    )


def hub_cache_folder(model: str) -> str | None:
    """The folder holding ``config.json`` of hub id ``model`` (``org/name``) in the local Hugging Face
    cache, if it was downloaded before; nothing is fetched."""
    if model.count("/") != 1 or os.path.exists(model):
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        path = try_to_load_from_cache(model, "config.json")
    except ValueError:  # not a valid repo id
        return None
    return os.path.dirname(path) if isinstance(path, str) else None


def check_model_source(model: Any, model_class: str | None = None) -> None:
    """What `build_model` would refuse, found without building anything (a launcher calls it
    before starting processes): a missing path, an unknown name, a config.json that is not JSON or
    names no class, an unknown ``model_class``, a ``module:function`` that does not import."""
    if isinstance(model, nn.Module):
        raise TypeError("pass a factory or a name, not a model: every process builds its own copy")
    if callable(model):
        return
    if model.startswith("timm:"):
        _timm_name(model)
        return
    if os.path.isdir(model):
        model_class_for(read_config(model), model, model_class)
    elif ":" in model:
        _import(model, "MODEL")
    elif hub_cache_folder(model) is None:
        resolve_model_name(model, {**builds(), **PLAN_DERIVED})  # raises: the message lists what MODEL can be


def _timm_name(spec: str) -> str:
    """The timm model name of ``timm:<name>``, or a ValueError when timm has no such model."""
    import timm

    name = spec[5:]
    if not timm.is_model(name):
        near = timm.list_models(f"*{name.split('_')[0]}*")[:8] if name else []
        raise ValueError(
            f"timm has no model named {name!r}"
            + (f" (similar: {', '.join(near)})" if near else "")
            + "; timm.list_models('*pattern*') lists the names"
        )
    return name


def read_config(folder: str):
    """The folder's config, or a ValueError naming config.json and what is wrong with it."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{folder} has no config.json (a model folder holds config.json and maybe weights)")
    try:
        with open(path, encoding="utf-8") as f:
            json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); write it with config.save_pretrained(folder)") from None
    try:
        return tf.AutoConfig.from_pretrained(folder)
    except (ValueError, KeyError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: transformers cannot read it: {first}") from None


def _from_folder(folder: str, model_class: str | None, weights: bool) -> nn.Module:
    config = read_config(folder)
    cls = model_class_for(config, folder, model_class)
    has_weights = any(f.endswith((".safetensors", ".bin")) for f in os.listdir(folder))
    return cls.from_pretrained(folder) if weights and has_weights else cls(config)


def load_policy(policy: Any):
    """None (the built-in policy), a Policy instance or class, or ``module:Class``."""
    if policy is None:
        return None
    if isinstance(policy, str):
        policy = _import(policy, "--policy")
    return policy() if isinstance(policy, type) else policy
