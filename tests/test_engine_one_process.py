"""ParallelEngine in one process (no process group): refusals that come before any collective, and
what holds at world size 1."""

import copy

import pytest
import torch
import torch.distributed as dist
import transformers as tf

from shardformer import EngineConfig, ParallelEngine
from shardformer.core.tiny import tiny_config
from tests.helpers import assert_close


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def test_a_loss_fn_with_context_parallelism_is_refused():
    """Each cp rank's output holds its chunk of the sequence: a loss_fn over it is not the unsharded
    model's loss (the engine sweep found Llama's weights off by 5e-4 after 2 steps). The model's own
    loss (labels in the batch) is what cp computes over the whole sequence."""
    with pytest.raises(ValueError, match=r"EngineConfig.cp=2 with a loss_fn: .* put the labels in the batch"):
        ParallelEngine(torch.nn.Linear(2, 2), _sgd, EngineConfig(cp=2), loss_fn=lambda out, batch: out.sum())


def test_activation_checkpointing_of_a_model_that_fills_its_cache_in_training():
    """CpmAnt fills a KV cache unless told not to: its recomputed layers found their keys already there
    (a shape error in backward, found by the engine sweep). The engine trains without a cache."""
    cls = tf.CpmAntForCausalLM
    torch.manual_seed(0)
    ref = cls(tiny_config(cls.config_class)).train()
    model = copy.deepcopy(ref)
    ids = torch.randint(3, 99, (2, 8), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # a group of one, in process
    try:
        engine = ParallelEngine(model, _sgd, EngineConfig(activation_checkpointing=True))
        loss = engine.train_step(batch)
    finally:
        dist.destroy_process_group()
    opt = _sgd(ref.parameters())
    expected = ref(**batch).loss
    expected.backward()
    opt.step()
    assert_close(torch.tensor(loss), expected.detach(), what="loss")
    for name, p in ref.named_parameters():
        assert_close(dict(engine.model.named_parameters())[name], p, what=f"{name} after a step")
