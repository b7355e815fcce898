"""On a CUDA device: tp=1 in one process, and tp=2 on two gloo ranks that share cuda:0, exact against
the unsharded model on the same device. Marked ``cuda`` (run them with ``pytest -m cuda``); skipped
where torch sees no CUDA device."""

import copy

import pytest
import torch
import torch.distributed as dist
import transformers as tf

from shardformer import ShardConfig, shard_model
from shardformer.core.tiny import tiny_config
from shardformer.tools.pair_check import load_pair
from tests.helpers import assert_close, assert_grads_match, check_table

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"
    ),
]
DEVICE = "cuda:0"


def _batch():
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    return {"input_ids": ids, "labels": ids}


def test_tp1_gpt2_forward_backward_on_cuda_matches_unsharded():
    torch.manual_seed(0)
    ref = tf.GPT2LMHeadModel(tiny_config(tf.GPT2Config)).to(DEVICE)
    model = shard_model(copy.deepcopy(ref), ShardConfig(tensor_parallel_size=1))
    assert next(model.parameters()).device.type == "cuda"
    out, expected = model(**_batch()), ref(**_batch())
    assert_close(out.logits, expected.logits, what="logits")
    assert_close(out.loss, expected.loss, what="loss")
    out.loss.backward()
    expected.loss.backward()
    assert_grads_match(model, ref)


def check_tp2_gloo_on_cuda_tensors():  # both ranks on cuda:0: gloo moves CUDA tensors through host memory
    ref, model = load_pair(tf.GPT2LMHeadModel, tiny_config(tf.GPT2Config))
    ref, model = ref.to(DEVICE), model.to(DEVICE)
    model = shard_model(model, ShardConfig(tensor_parallel_size=dist.get_world_size()))
    out, expected = model(**_batch()), ref(**_batch())
    assert_close(out.loss, expected.loss, what="loss")
    out.loss.backward()
    expected.loss.backward()
    assert_grads_match(model, ref)


test_two_gloo_ranks_on_one_gpu = check_table([check_tp2_gloo_on_cuda_tensors], 2)
