"""Stage split and errors, in one process: no ranks to spawn.

The stages of every built-in policy, run one after another, compute the unsharded model's loss;
parameter names are the unsharded model's; bad sizes raise errors that name the fix.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from shardformer import EngineConfig, ParallelEngine, PipelineSpec, ShardConfig, shard_model
from shardformer.core.config import SHARD_FIELDS
from shardformer.engine import split_batch
from shardformer.pipeline import balanced_split, check_split, local_layers, stage_of
from shardformer.policies.anatomy_pipeline import pipeline_spec_for
from tests.helpers import assert_close
from tests.pipeline import common
from tests.policies import zoo


def _chain(spec, stages, inputs):
    hidden = None
    for m in stages:
        hidden = spec.stage_forward(m, hidden, inputs)
    return hidden


@pytest.mark.parametrize(
    ("name", "impl"),
    [
        ("GPT2LMHeadModel", "eager"),
        ("GPT2LMHeadModel", "sdpa"),
        ("BertForMaskedLM", "sdpa"),
        ("ViTForImageClassification", "eager"),
    ],
)
def test_stages_in_sequence_equal_the_model(name, impl):
    ref, model = zoo.load_twice(name, impl, config=common.config(name))
    spec = pipeline_spec_for(model)
    model = shard_model(model)
    split = [1, 2, 1]  # a middle stage holds neither end (nor the tied embedding)
    stages = [spec.keep_stage(copy.deepcopy(model), s, 3, split) for s in range(3)]
    inputs = common.batches(name, 1)[0]
    out = _chain(spec, stages, inputs)
    expected = ref(**inputs)
    assert_close(out.loss, expected.loss, what=f"{name}/{impl} loss")
    assert_close(out.logits, expected.logits, what=f"{name}/{impl} logits")
    full = {n for n, _ in ref.named_parameters()}
    names = [{n for n, _ in m.named_parameters()} for m in stages]
    assert all(n <= full for n in names) and set().union(*names) == full
    assert stage_of(stages[0]) == (0, 3) and stages[1].shardformer.layers == (1, 2)


@pytest.mark.parametrize("name", ["GPT2LMHeadModel", "BertForMaskedLM"])
def test_stages_in_training_apply_each_dropout_once(name):
    """With dropout on, the stages in sequence equal the one-stage model (each dropout keeps its own
    seeded generator, copied with the model): the embedding dropout runs on the first stage only."""
    config = common.config(name)
    for key in ("embd_pdrop", "resid_pdrop", "attn_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob"):
        if hasattr(config, key):
            setattr(config, key, 0.3)
    _, model = zoo.load_twice(name, config=config)
    spec = pipeline_spec_for(model)
    model = shard_model(model).train()
    whole = spec.keep_stage(copy.deepcopy(model), 0, 1)
    stages = [spec.keep_stage(copy.deepcopy(model), s, 3, [1, 2, 1]) for s in range(3)]
    inputs = common.batches(name, 1)[0]
    expected = spec.stage_forward(whole, None, inputs)
    assert_close(_chain(spec, stages, inputs).loss, expected.loss, what=f"{name} loss with dropout")


def test_timm_stages_in_sequence_equal_the_model():
    ref, model = zoo.timm_pair()
    spec = pipeline_spec_for(model)
    model = shard_model(model)
    stages = [spec.keep_stage(copy.deepcopy(model), s, 2) for s in range(2)]
    x = torch.randn(2, 3, 16, 16)
    assert_close(_chain(spec, stages, {"x": x}), ref(x), what="timm logits")
    assert stages[1].cls_token is None and stages[0].head is None
    whole = spec.keep_stage(copy.deepcopy(model), 0, 1)  # one stage: the model's own forward
    assert_close(spec.stage_forward(whole, None, {"x": x}), ref(x), what="timm logits, one stage")


def test_balanced_split():
    assert balanced_split(4, 4) == [1, 1, 1, 1]
    assert balanced_split(5, 3) == [2, 2, 1]  # extra layers to middle stages, then the first
    assert balanced_split(7, 2) == [4, 3]
    assert check_split(6, 3, [1, 2, 3]) == [1, 2, 3]


@pytest.mark.parametrize(
    ("args", "fix"),
    [
        ((2, 4, None), "use pipeline_parallel_size <= 2"),
        ((4, 2, [1, 2, 1]), "must list 2 positive integers"),
        ((4, 2, [1, 2]), "it must sum to the 4 layers"),
        ((4, 2, [0, 4]), "positive integers"),
    ],
)
def test_bad_split_names_the_fix(args, fix):
    with pytest.raises(ValueError, match=fix):
        check_split(*args)


def test_more_stages_than_layers_raises_before_changing_the_model():
    _, model = zoo.load_twice("GPT2LMHeadModel")  # 2 layers
    with pytest.raises(ValueError, match="more stages than the model's 2 layers"):
        pipeline_spec_for(model).keep_stage(model, 0, 3)
    assert all(b is not None for b in model.transformer.h)


def test_microbatches_that_do_not_divide_the_batch():
    with pytest.raises(ValueError, match="batch size 6 does not divide into num_microbatches=4"):
        split_batch({"x": torch.zeros(6, 2)}, 4, "num_microbatches")


def test_world_size_that_does_not_fit_raises_before_any_collective():
    _, model = zoo.load_twice("GPT2LMHeadModel")
    with pytest.raises(ValueError, match="make the product equal the number of processes|launch a multiple"):
        ParallelEngine(model, common.sgd, EngineConfig(tp=2, pp=2, dp=2))


def test_optimizer_must_be_a_factory():
    _, model = zoo.load_twice("GPT2LMHeadModel")
    with pytest.raises(TypeError, match="factory"):
        ParallelEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), EngineConfig())


@pytest.mark.parametrize(
    ("kwargs", "fix"),
    [
        ({"zero_stage": 4}, "must be 1, 2 or 3"),
        ({"schedule": "interleaved"}, "must be one of"),
        ({"num_microbatches": 0}, "positive integer"),
        ({"precision": "fp8"}, "must be one of"),
        ({"compile": "yes"}, r"compile='yes' must be True or False"),
        (
            {"compile": True, "compile_backend": "fast"},
            r"compile_backend='fast' is not a torch.compile backend.*inductor",
        ),
        ({"overlap_p2p": "yes"}, r"overlap_p2p='yes' must be True or False"),
        ({"overlap_grad_reduce": 1}, r"overlap_grad_reduce=1 must be True or False"),
        ({"dp": 0}, r"EngineConfig.dp=0 must be a positive integer or None"),
        ({"gather_output": "yes"}, r"EngineConfig.gather_output='yes' must be True or False"),
        ({"vocab_pad_multiple": 0}, r"EngineConfig.vocab_pad_multiple=0 must be a positive integer"),
        ({"overlap_communication": 1}, r"EngineConfig.overlap_communication=1 must be True or False"),
    ],
)
def test_bad_engine_config(kwargs, fix):
    with pytest.raises(ValueError, match=fix):
        EngineConfig(**kwargs)


def test_engine_config_builds_the_shard_config():
    class Mesh:
        dp_size = 2

    mesh = Mesh()
    knobs = {"seed": 7, "gather_output": True, "vocab_pad_multiple": 64, "overlap_communication": False}
    shard = EngineConfig(sequence_parallel=True, **knobs).shard_config(mesh)
    assert (shard.tensor_parallel_size, shard.pipeline_parallel_size, shard.data_parallel_size) == (1, 1, 2)
    assert shard.mesh is mesh and shard.sequence_parallel
    assert all(getattr(shard, name) == value for name, value in knobs.items())
    defaults = EngineConfig().shard_config(mesh)  # ShardConfig's own defaults
    assert all(getattr(defaults, name) == getattr(ShardConfig(), name) for name in SHARD_FIELDS)


def test_model_without_pipeline_spec_names_the_fix():
    with pytest.raises(NotImplementedError, match=r"pipeline=PipelineSpec\(layers="):
        pipeline_spec_for(torch.nn.Linear(2, 2))


def tiny_stage_forward(model, hidden, inputs):
    stage, n = stage_of(model)
    if stage == 0:
        hidden = model.embed(inputs["x"])
    for layer in local_layers(model, model.layers):
        hidden = torch.tanh(layer(hidden))
    return model.head(hidden) if stage == n - 1 else hidden


# A custom model pipelined by a custom spec (no tensor parallel layers needed).
TINY_SPEC = PipelineSpec(layers="layers", first=("embed",), last=("head",), stage_forward=tiny_stage_forward)


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(3, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def test_custom_policy_splits_the_same_way():
    torch.manual_seed(0)
    model = Tiny()
    stages = [TINY_SPEC.keep_stage(copy.deepcopy(model), s, 2) for s in range(2)]
    assert [m.shardformer.layers for m in stages] == [(0, 1), (2,)]
    x = torch.randn(4, 3)
    assert_close(_chain(TINY_SPEC, stages, {"x": x}), model(x), what="custom stages")
    assert F.mse_loss(_chain(TINY_SPEC, stages, {"x": x}), model(x)).item() < 1e-12


def test_a_stage_reads_dropped_modules_from_their_skeletons_and_holds_none_of_their_weights():
    """BigBird sets every layer's attention type, DeiT reads its patch embedding's sizes: on a stage
    that dropped them, their stand-ins answer from a meta-device skeleton outside the module tree."""
    import transformers as tf

    from shardformer.pipeline.skeleton import skeleton_of
    from shardformer.pipeline.stage_view import stage_view

    config = tf.BigBirdConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        attention_type="original_full",
    )  # fmt: skip
    torch.manual_seed(0)
    full = tf.BigBirdForMaskedLM(config).eval()
    spec = pipeline_spec_for(full)
    stages = [spec.keep_stage(copy.deepcopy(full), s, 2) for s in range(2)]
    ids = torch.randint(3, 99, (2, 8))
    assert_close(_chain(spec, stages, {"input_ids": ids, "labels": ids}).loss, full(input_ids=ids, labels=ids).loss)
    layer = skeleton_of(stages[1], spec.layer_paths(full)[0])
    assert layer is not None and all(p.is_meta for p in layer.parameters())
    held = {id(p) for p in stages[1].parameters()}
    assert not held & {id(p) for p in layer.parameters()}
    with stage_view(stages[1]):  # the stand-in answers a method call from the skeleton
        stages[1].get_submodule(spec.layer_paths(full)[0]).set_attention_type("original_full")
