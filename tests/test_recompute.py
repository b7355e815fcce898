"""Activation checkpointing on sharded models recomputes exactly: the seeded dropout masks replay.

One process (tp=1 still swaps every dropout for a seeded one), dropout on: a model with
checkpointing gives the loss and every gradient of the same model without it. Without the replay
the recompute draws new masks and the gradients belong to another forward (the check fails).
The multi-rank case (pp=2 x tp=2 through the engine) is in tests/pipeline/test_engine.py.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from timm.models.vision_transformer import VisionTransformer

from shardformer import ShardConfig, shard_model
from shardformer.tensor_parallel.recompute import checkpoint_layers
from tests.helpers import GRAD_ATOL, GRAD_RTOL, assert_close
from tests.policies import zoo


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _same_step(plain, checkpointed, run):
    """Loss and gradients of one training step, with and without checkpointing, from one RNG state."""
    results = []
    for model in (plain, checkpointed):
        torch.manual_seed(5)
        model.train()
        loss = run(model)
        loss.backward()
        results.append((loss.detach(), _grads(model)))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert_close(loss_b, loss_a, what="loss")
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        assert_close(grads_b[name], grads_a[name], GRAD_ATOL, GRAD_RTOL, what=f"grad of {name}")


@pytest.mark.parametrize("enable_before_sharding", [False, True])
def test_transformers_checkpointing_replays_dropout(enable_before_sharding):
    config = zoo.gpt2_config()
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.2
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(config)
    other = copy.deepcopy(model)
    if enable_before_sharding:
        other.activation_checkpointing_enable()
    plain, checkpointed = shard_model(model, ShardConfig()), shard_model(other, ShardConfig())
    if not enable_before_sharding:
        checkpointed.activation_checkpointing_enable()
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    _same_step(plain, checkpointed, lambda m: m(input_ids=ids, labels=ids).loss)


def test_checkpoint_layers_replays_dropout_in_timm():
    torch.manual_seed(0)
    kwargs = dict(img_size=16, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=3)
    model = VisionTransformer(**kwargs, drop_rate=0.2, attn_drop_rate=0.2, proj_drop_rate=0.2)
    other = copy.deepcopy(model)
    plain, checkpointed = shard_model(model, ShardConfig()), shard_model(other, ShardConfig())
    checkpoint_layers(checkpointed.blocks)
    x, y = torch.randn(2, 3, 16, 16), torch.tensor([0, 2])
    _same_step(plain, checkpointed, lambda m: F.cross_entropy(m(x), y))
