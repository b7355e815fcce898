"""ParallelEngine in one process (no process group): refusals that come before any collective, and
what holds at world size 1."""

import copy

import pytest
import torch
import torch.distributed as dist
import transformers as tf

from shardformer import EngineConfig, ParallelEngine
from shardformer.core.tiny import tiny_config
from shardformer.data_parallel.running_stats import (
    check_recomputed_statistics,
    check_split_statistics,
    tracking_modules,
)
from shardformer.pipeline import PipelineSpec
from shardformer.tensor_parallel.recompute import recomputed_modules
from tests.helpers import assert_close
from tests.pipeline.common import reference_run


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


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.norm = torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4)

    def forward(self, x):
        return x + torch.relu(self.norm(self.conv(x)))


class _ConvNet(torch.nn.Module):
    """A convnet with a stack of blocks, each with a BatchNorm that tracks running statistics."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.blocks = torch.nn.ModuleList([_Block() for _ in range(2)])
        self.head = torch.nn.Linear(4, 5)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


def _class_loss(out, batch):
    return torch.nn.functional.cross_entropy(out, batch["y"])


def test_micro_batches_chain_running_statistics_as_gradient_accumulation_does():
    """On one rank the micro-batches update BatchNorm's running statistics chunk after chunk, as the unsharded
    model's gradient accumulation over the same chunks does: accepted, buffers and weights equal."""
    torch.manual_seed(0)
    ref = _ConvNet()
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(4, 3, 6, 6, generator=g), "y": torch.randint(0, 5, (4,), generator=g)} for _ in "ab"]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        engine = ParallelEngine(model, _sgd, EngineConfig(num_microbatches=2), loss_fn=_class_loss)
        losses = [engine.train_step(b) for b in batches]
    finally:
        dist.destroy_process_group()
    expected = reference_run(ref, batches, 2, loss_fn=_class_loss, optimizer=_sgd)
    assert_close(torch.tensor(losses), torch.tensor(expected), what="losses")
    buffers = dict(engine.model.named_buffers())
    for name, value in ref.named_buffers():
        assert_close(buffers[name].float(), value.float(), what=f"buffer {name}")
    assert int(buffers["blocks.0.norm.num_batches_tracked"]) == 4  # two steps of two micro-batches


def test_running_statistics_recomputed_by_activation_checkpointing_are_refused():
    """A recomputed forward would update the running statistics a second time (torch's checkpoint does)."""
    spec = PipelineSpec(
        layers="blocks", stage_forward=lambda model, x, batch: model(x), first=("stem",), last=("head",)
    )
    with pytest.raises(ValueError, match=r"activation checkpointing: 2 BatchNorm2d modules \(blocks.0.norm, blocks.1"):
        ParallelEngine(
            _ConvNet(), _sgd, EngineConfig(activation_checkpointing=True), pipeline=spec, loss_fn=_class_loss
        )


def test_a_transformers_model_recomputes_what_carries_its_checkpointing_flag():
    """transformers recomputes its checkpointing layers (not the model that carries the flag too): a norm
    inside a layer is recomputed, one in the head is not."""
    bert = tf.BertForSequenceClassification(tiny_config(tf.BertConfig))
    assert recomputed_modules(bert, None) == ["bert.encoder.layer.0", "bert.encoder.layer.1"]
    bert.classifier = torch.nn.Sequential(torch.nn.BatchNorm1d(bert.config.hidden_size), bert.classifier)
    check_recomputed_statistics(bert, "ParallelEngine", recomputed_modules(bert, None))  # the head: run once
    bert.bert.encoder.layer[0].output.dense = torch.nn.Sequential(
        bert.bert.encoder.layer[0].output.dense, torch.nn.BatchNorm1d(8)
    )
    with pytest.raises(ValueError, match=r"1 BatchNorm1d module \(bert.encoder.layer.0.output.dense.1\)"):
        check_recomputed_statistics(bert, "ParallelEngine", recomputed_modules(bert, None))


def test_norms_without_running_statistics_are_not_counted():
    """GroupNorm and LayerNorm keep no running statistics; a norm whose statistics are frozen
    (track_running_stats=False) or that the model's own ``train`` keeps in eval updates none; the training
    flags are put back."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.GroupNorm(2, 4), torch.nn.LayerNorm(4)).eval()
    assert tracking_modules(model) == [] and not model.training and not model[1].training
    net = _ConvNet()
    net.blocks[0].norm.track_running_stats = False
    assert tracking_modules(net) == ["blocks.1.norm"]
    check_split_statistics(model, "ParallelEngine", {"dp": 2})
    net.train = lambda mode=True: torch.nn.Module.train(net, mode) and net.blocks[1].norm.eval() and net
    assert tracking_modules(net) == [] and net.blocks[1].norm.training
    del net.train
    with pytest.raises(ValueError, match=r"ParallelEngine at dp=2: 1 BatchNorm2d module \(blocks.1.norm\)"):
        check_split_statistics(net, "ParallelEngine", {"dp": 2, "cp": 1})
