"""Tiny transformers models for the derived route, importable by spawned ranks.

``LiarForCausalLM`` names every projection after another one's role (its fused ``[Q | K | V]`` is
``down_proj``, its attention output ``q_proj``, its fused ``[gate | up]`` ``o_proj``, its MLP output
``up_proj``): the derived policy must cut it by what the projections do. ``head_scale=True`` adds a
per-dimension scale of the queries owned by the attention itself, shared by the heads, whose gradient a
tp cut leaves partial: the policy sums it over the ranks. ``head_scale="both"`` also scales the
attention's input with it (a gradient part whole, part per rank: no sum is exact, the proof must
refuse it). ``mix_heads=True`` makes each query feature depend on every head's (no cut
over heads computes it: not derivable). ``head_norm=True`` adds a per-head norm module between q and the attention
(a replicated leaf whose gradient the policy sums). ``channel_norm=True`` adds a BatchNorm over the MLP's
inner channels (LeViT's linear-then-BatchNorm: per channel, cut with the channels).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers as tf
from transformers.modeling_outputs import CausalLMOutput

from shardformer.core.tiny import fill_zero_matrices, tiny_config, tiny_copy_config
from shardformer.core.tiny_run import runnable_tiny_config
from shardformer.models import inputs_for


class LiarConfig(tf.PretrainedConfig):
    model_type = "shardformer-liar"

    def __init__(self, vocab_size=99, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                 num_hidden_layers=2, head_scale=False, head_norm=False, mix_heads=False, head_reads_weight=False,
                 channel_norm=False, **kwargs):  # fmt: skip
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_attention_heads, self.num_hidden_layers = num_attention_heads, num_hidden_layers
        self.head_scale, self.head_norm, self.mix_heads = head_scale, head_norm, mix_heads
        self.head_reads_weight = head_reads_weight  # the model's code multiplies by lm_head.weight (MobileBERT's)
        self.channel_norm = channel_norm
        super().__init__(**kwargs)


class LiarAttention(nn.Module):
    def __init__(self, config: LiarConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.down_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size)  # in truth: [Q | K | V]
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)  # in truth: the output projection
        self.head_scale = nn.Parameter(torch.linspace(0.5, 1.5, self.head_dim)) if config.head_scale else None
        self.q_norm = nn.LayerNorm(self.head_dim) if config.head_norm else None
        self.mix_heads = config.mix_heads
        self.scale_input = config.head_scale == "both"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        if self.head_scale is not None and self.scale_input:
            x = x * self.head_scale.repeat(x.shape[-1] // self.head_dim)
        q, k, v = self.down_proj(x).chunk(3, dim=-1)
        if self.mix_heads:  # every query feature depends on all heads': no cut over heads is exact
            q = q - q.mean(dim=-1, keepdim=True)
        q, k, v = (t.view(b, s, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.head_scale is not None:
            q = q * self.head_scale
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.q_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class LiarBlock(nn.Module):
    def __init__(self, config: LiarConfig) -> None:
        super().__init__()
        self.norm_a, self.norm_b = nn.LayerNorm(config.hidden_size), nn.LayerNorm(config.hidden_size)
        self.mixer = LiarAttention(config)
        self.o_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)  # [gate | up]
        self.up_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)  # the MLP's output
        self.channels = nn.BatchNorm1d(config.intermediate_size) if config.channel_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.norm_a(x))
        gate, up = self.o_proj(self.norm_b(x)).chunk(2, dim=-1)
        inner = F.silu(gate) * up
        if self.channels is not None:
            inner = self.channels(inner.flatten(0, 1)).view(inner.shape)
        return x + self.up_proj(inner)


class LiarForCausalLM(tf.PreTrainedModel):
    config_class = LiarConfig

    def __init__(self, config: LiarConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LiarBlock(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, labels=None, **_):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        if self.config.head_reads_weight:
            logits = self.norm(x) @ self.lm_head.weight.t()
        else:
            logits = self.lm_head(self.norm(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return CausalLMOutput(loss=loss, logits=logits)


def liar(**options) -> LiarForCausalLM:
    torch.manual_seed(0)
    return LiarForCausalLM(
        LiarConfig(hidden_size=64, num_attention_heads=8, intermediate_size=96, num_hidden_layers=3, **options)
    )


def transformers_model(name: str, tp: int = 2, **options) -> nn.Module:
    """A small random ``transformers.<name>`` from its default config (the user's choices in ``options``)."""
    cls = getattr(tf, name)
    torch.manual_seed(0)
    model = cls(tiny_copy_config(cls.config_class(**options), tp))
    fill_zero_matrices(model)  # BLIP-2's query tokens: zeros before a norm make rounding huge gradients
    return model


def runnable_model(name: str) -> nn.Module:
    """A small random ``transformers.<name>``: the recipe's first scaling of its default config that runs
    (Bros's boxes, an audio encoder's features: what the sweep builds)."""
    cls = getattr(tf, name)
    config = runnable_tiny_config(cls, cls.config_class(), 2, inputs=inputs_for)
    torch.manual_seed(0)
    model = cls(config)
    fill_zero_matrices(model)
    return model


def config_model(name: str, **config) -> nn.Module:
    """A random ``transformers.<name>`` from exactly this config (not scaled down: the user's sizes)."""
    cls = getattr(tf, name)
    torch.manual_seed(0)
    return cls(cls.config_class(**config))


def factory(name: str, **options):
    """A picklable factory for spawned ranks (``"sized:<Class>"``: the config as given;
    ``"runnable:<Class>"``: `runnable_model`)."""
    if name == "liar":
        return functools.partial(liar, **options)
    if name.startswith("runnable:"):
        return functools.partial(runnable_model, name.removeprefix("runnable:"))
    if name.startswith("sized:"):
        return functools.partial(config_model, name.removeprefix("sized:"), **options)
    return functools.partial(transformers_model, name, **options)


def save_tiny(cls_name: str, options: dict, path: str, perturb) -> None:
    """A tiny ``transformers.<cls_name>`` (``options`` on its tiny config) saved at ``path`` after
    ``perturb(name, param)`` made the weights a test cares about distinct."""
    cls = getattr(tf, cls_name)
    torch.manual_seed(0)
    model = cls(tiny_config(cls.config_class, **options))
    with torch.no_grad():
        for name, param in model.named_parameters():
            perturb(name, param)
    model.save_pretrained(path)
