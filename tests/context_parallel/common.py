"""Tiny causal LMs, a right-padded batch, and the parity check of a context-parallel model against
the unsharded one: logits (gathered), loss, every gradient, weights after an SGD step."""

import torch
import transformers as tf

from shardformer import sharding_of
from shardformer.core.tiny import tiny_config
from shardformer.tensor_parallel.layers import gather_from_parallel
from shardformer.tools.conformance import load_pair
from tests.helpers import GRAD_ATOL, GRAD_RTOL, assert_close, assert_grads_match, full_of

VOCAB = 99
MODELS = {
    "llama": (tf.LlamaForCausalLM, tf.LlamaConfig, {}),
    "qwen3": (tf.Qwen3ForCausalLM, tf.Qwen3Config, {}),
    "mistral": (tf.MistralForCausalLM, tf.MistralConfig, {"sliding_window": 4}),  # shorter than the sequence
    "gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config, {}),
    "opt": (tf.OPTForCausalLM, tf.OPTConfig, {}),  # the derived route: no transformers tp plan
}


def pair(name, impl="sdpa", **overrides):
    cls, config_cls, extra = MODELS[name]
    return load_pair(cls, tiny_config(config_cls, **{**extra, **overrides}), impl)


def batch(seq, rows=2, seed=1):
    """Right-padded: the last row's final 3 tokens are padding (masked, no labels)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, seq), generator=g)
    mask = torch.ones(rows, seq, dtype=torch.long)
    mask[-1, -3:] = 0
    labels = ids.masked_fill(mask == 0, -100).masked_fill(torch.rand(rows, seq, generator=g) < 0.2, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def full_logits(model, logits, seq):
    """The model's split (and vocab-parallel) logits as the unsharded model gives them."""
    info = sharding_of(model)
    logits = info.context_parallel.gather(logits, seq)
    if logits.shape[-1] != VOCAB:
        logits = gather_from_parallel(logits, info.tp_group, VOCAB)
    return logits


def parity(ref, model, inputs, what):
    """A causal LM: logits and loss; a base model (no labels): its hidden states and a fixed random
    projection of them as the loss."""
    ref.train()
    model.train()
    seq = inputs["input_ids"].shape[1]
    expected, got = ref(**inputs), model(**inputs)
    if "labels" in inputs:
        # every position, the padded ones too (right padding: they attend the real tokens before them)
        assert_close(full_logits(model, got.logits, seq), expected.logits, what=f"{what}: logits")
        expected_loss, loss = expected.loss, got.loss
    else:
        hidden = sharding_of(model).context_parallel.gather(got.last_hidden_state, seq)
        assert_close(hidden, expected.last_hidden_state, what=f"{what}: hidden states")
        weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(5))
        expected_loss, loss = (expected.last_hidden_state * weights).sum(), (hidden * weights).sum()
    assert_close(loss, expected_loss, what=f"{what}: loss")
    expected_loss.backward()
    loss.backward()
    tp_group = sharding_of(model).tp_group
    assert_grads_match(model, ref, tp_group)
    for m in (ref, model):
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9).step()
    full = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert_close(full_of(p.detach(), p, tp_group), full[name].detach(), GRAD_ATOL, GRAD_RTOL, f"{what}: {name}")
