"""Tiny causal LMs, a right-padded batch, and the parity check of a context-parallel model against
the unsharded one: logits (gathered), loss, every gradient, weights after an SGD step."""

from contextlib import contextmanager

import torch
import transformers as tf

from shardformer import sharding_of
from shardformer.core.tiny import tiny_config
from shardformer.tensor_parallel.layers import gather_from_parallel
from shardformer.tools.pair_check import load_pair
from tests.helpers import GRAD_ATOL, GRAD_RTOL, assert_close, assert_grads_match, full_of

VOCAB = 99
MODELS = {
    "llama": (tf.LlamaForCausalLM, tf.LlamaConfig, {}),
    "qwen3": (tf.Qwen3ForCausalLM, tf.Qwen3Config, {}),
    "mistral": (tf.MistralForCausalLM, tf.MistralConfig, {"sliding_window": 4}),  # shorter than the sequence
    "gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config, {}),
    # the derived route (no transformers tp plan); ffn_dim 64, not its default 3072: 3072 ReLU inputs per
    # token and layer put some within fp32 rounding of 0 (see KINK_MARGIN)
    "opt": (tf.OPTForCausalLM, tf.OPTConfig, {"ffn_dim": 64}),
}
# A ReLU input this close to 0 may change sign between two computations equal up to fp32 rounding (the
# ring's blockwise softmax moves it by ~3e-8 here, as another CPU's kernels move the unsharded one), and
# with it the gradient of a whole unit: such data cannot tell an exact split from a wrong one.
KINK_MARGIN = 1e-6


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


@contextmanager
def clear_of_kinks(model, what):
    """Every ReLU input ``model`` computes inside the block is at least KINK_MARGIN from 0."""
    closest = [float("inf")]

    def record(_, args):
        closest[0] = min(closest[0], args[0].detach().abs().min().item())

    hooks = [m.register_forward_pre_hook(record) for m in model.modules() if isinstance(m, torch.nn.ReLU)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
    assert closest[0] >= KINK_MARGIN, (
        f"{what}: a ReLU input is {closest[0]:.1e} from 0: rounding may flip its gradient; use other data or sizes"
    )


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
    with clear_of_kinks(ref, what):
        expected = ref(**inputs)
    got = model(**inputs)
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
