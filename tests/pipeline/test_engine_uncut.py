"""ParallelEngine at tensor_parallel_size=1 on models no tensor-parallel route cuts, on 2 gloo ranks against
one process training the unsharded model on the same batches (losses, and every weight after two AdamW
steps): data parallelism needs no cut, so ALBERT (one layer's weights applied at every depth, no route)
and a timm ResNet (convolutions; its BatchNorms frozen, refused while they track running statistics) train
at dp=2 under ZeRO-1 and ZeRO-3, kept whole (route "none: tp=1"), buffers equal too.
ELECTRA with an embedding narrower than its hidden size splits at pp=2: its ``embeddings_project``, between
the embeddings and the layers, sits on the first stage; so do wav2vec2's feature encoder and projection (ALBERT at
pp=2 is refused naming its shared layer: tests/pipeline/test_engine_anatomy.py). A bare nn.TransformerEncoder
trains at tp=2 given EngineConfig(example_inputs=...). One spawn."""

import copy

import pytest
import torch
import transformers as tf

from shardformer import EngineConfig, ParallelEngine
from shardformer.core.inputs import make_inputs
from shardformer.core.tiny import tiny_config
from shardformer.policies.anatomy_pipeline import pipeline_spec_for
from shardformer.policies.routes import NONE
from shardformer.tools.pair_check import load_pair
from tests.helpers import assert_close, check_table
from tests.pipeline import common
from tests.pipeline.test_engine import _check

STEPS = 2


def _albert(zero_stage):
    pair = load_pair(tf.AlbertForMaskedLM, tiny_config(tf.AlbertConfig))
    engine = _check(
        "albert", 1, 1, 2, "1f1b", 1, None, zero_stage=zero_stage, model_pair=pair,
        data=common.batches("Albert", STEPS), optimizer=common.adamw,
    )  # fmt: skip
    assert engine.model.shardformer.route == NONE, engine.model.shardformer.route


def _resnet():
    from timm.models.resnet import BasicBlock, ResNet

    torch.manual_seed(0)
    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=5, channels=(8, 8, 16, 16), stem_width=8)


def _resnet_loss(out, micro_batch):
    return torch.nn.functional.cross_entropy(out, micro_batch["y"])


def _images(steps=STEPS):
    g = torch.Generator().manual_seed(0)
    return [
        {"x": torch.randn(common.BATCH, 3, 16, 16, generator=g), "y": torch.randint(0, 5, (common.BATCH,), generator=g)}
        for _ in range(steps)
    ]


def frozen_statistics(model):
    """Every BatchNorm of ``model`` keeps its running statistics (the fix the refusal names)."""
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.track_running_stats = False
    return model


def assert_buffers_equal(model, ref, what):
    """Every buffer this rank holds (running statistics, counters) equals the unsharded model's."""
    expected = dict(ref.named_buffers())
    for name, value in model.named_buffers():
        assert_close(value.float(), expected[name].float(), what=f"{what}: buffer {name}")


def _convnet(zero_stage):
    """Frozen statistics: the parameters and the buffers equal the unsharded model's after two steps."""
    model = frozen_statistics(_resnet())
    ref = copy.deepcopy(model)
    engine = _check(
        "resnet", 1, 1, 2, "1f1b", 1, None, zero_stage=zero_stage, model_pair=(ref, model),
        loss_fn=_resnet_loss, data=_images(), optimizer=common.adamw,
    )  # fmt: skip
    assert engine.model.shardformer.route == NONE, engine.model.shardformer.route
    assert_buffers_equal(engine.model, ref, f"resnet dp=2 ZeRO-{zero_stage}")


def check_albert_dp2_zero1():
    _albert(1)


def check_albert_dp2_zero3():
    _albert(3)


def check_resnet_dp2_zero1():
    _convnet(1)


def check_resnet_dp2_zero3():
    _convnet(3)


def check_resnet_tracking_statistics_at_dp2_is_refused():
    """Each dp rank would update the running statistics from its half of the batch only."""
    with pytest.raises(ValueError) as refused:
        ParallelEngine(_resnet(), common.adamw, EngineConfig(tp=1, pp=1, dp=2), loss_fn=_resnet_loss)
    message = str(refused.value)
    assert message.startswith(
        "ParallelEngine at dp=2: 13 BatchNorm2d modules (bn1, layer1.0.bn1, layer1.0.bn2, layer1.0.downsample.1 and 9 more)"
    ), message
    assert "module.track_running_stats = False" in message and "SyncBatchNorm" in message, message


# the widths the tiny copy of the anatomy's proof once made equal (32 beside a hidden size scaled to 32)
ELECTRA = dict(embedding_size=32, hidden_size=64, num_attention_heads=4, intermediate_size=64, num_hidden_layers=4)


def check_electra_narrow_embedding_pp2():
    pair = load_pair(tf.ElectraForMaskedLM, tiny_config(tf.ElectraConfig, **ELECTRA))
    engine = _check(
        "electra", 1, 2, 1, "1f1b", 2, None, model_pair=pair, data=common.batches("Electra", STEPS),
        optimizer=common.adamw,
    )  # fmt: skip
    assert "electra.embeddings_project" in engine.pipeline.first, engine.pipeline.first


def check_wav2vec2_feature_encoder_pp2():
    """wav2vec2 for CTC at pp=2 (two micro-batches): its feature encoder, projection and positional convolution
    (weight-normed) run before the layers, on the first stage; the second stage stands in zeros shaped as they
    return (a tuple from the projection), found on the meta device."""
    pair = load_pair(tf.Wav2Vec2ForCTC, tiny_config(tf.Wav2Vec2Config))
    data = [make_inputs(pair[0], seed, batch=common.BATCH) for seed in range(STEPS)]
    engine = _check("wav2vec2", 1, 2, 1, "1f1b", 2, None, model_pair=pair, data=data, optimizer=common.adamw)
    assert engine.pipeline.first[:2] == ("wav2vec2.feature_extractor", "wav2vec2.feature_projection"), engine.pipeline


def check_bare_encoder_tp2_with_example_inputs():
    """A bare nn.TransformerEncoder (refused without inputs) at tp=2 through EngineConfig(example_inputs=...):
    proven on them; two SGD steps equal the unsharded encoder's (losses, every weight; SGD: the key bias's gradient is
    zero in theory, and Adam would turn its rounding noise into steps)."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    data = [{"src": torch.randn(common.BATCH, 6, 32, generator=g), "y": torch.randn(common.BATCH, 6, 32, generator=g)}]
    data.append({k: v.flip(0) for k, v in data[0].items()})

    def loss_fn(out, batch):
        return torch.nn.functional.mse_loss(out, batch["y"])

    config = EngineConfig(tp=2, example_inputs={"src": data[0]["src"][:2]})
    engine = ParallelEngine(model, common.sgd, config, loss_fn=loss_fn)
    assert engine.model.shardformer.route == "derived" and engine.model.shardformer.proven
    got = [engine.train_step(batch) for batch in data]
    optimizer, expected = common.sgd(ref.parameters()), []
    for batch in data:
        optimizer.zero_grad()
        loss = loss_fn(ref(batch["src"]), batch)
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    assert_close(torch.tensor(got), torch.tensor(expected), what="bare encoder tp=2: losses")
    weights, _ = common.gathered_weights(engine.model, engine.mesh.tp_group)
    for name, value in ref.named_parameters():
        assert_close(weights[name], value.detach(), what=f"bare encoder tp=2: {name} after {STEPS} steps")


CHECKS = [
    check_albert_dp2_zero1,
    check_albert_dp2_zero3,
    check_resnet_dp2_zero1,
    check_resnet_dp2_zero3,
    check_resnet_tracking_statistics_at_dp2_is_refused,
    check_electra_narrow_embedding_pp2,
    check_wav2vec2_feature_encoder_pp2,
    check_bare_encoder_tp2_with_example_inputs,
]
test_engine_uncut_2_ranks = check_table(CHECKS, 2)


@pytest.mark.parametrize("widths", [(16, 32), (32, 64), (64, 32)])
def test_a_projection_between_embeddings_and_layers_is_on_the_first_stage(widths):
    embedding, hidden = widths
    config = tf.ElectraConfig(
        vocab_size=99, embedding_size=embedding, hidden_size=hidden, num_hidden_layers=2, intermediate_size=64
    )
    spec = pipeline_spec_for(tf.ElectraForSequenceClassification(config))
    assert spec.first == ("electra.embeddings", "electra.embeddings_project"), spec.first


def test_a_module_the_tiny_copy_lacks_is_named_not_left_to_the_user(monkeypatch):
    """Where a tiny copy lacks a module of the user's model (here: the copy's widths made equal by hand), the
    refusal names the module and why, and asks for no edit of a spec the user never wrote."""
    from shardformer.core import tiny

    monkeypatch.setattr(tiny, "_keep_apart", lambda *_: None)
    config = tf.ElectraConfig(
        vocab_size=99, embedding_size=32, hidden_size=96, num_hidden_layers=2, intermediate_size=64
    )
    with pytest.raises(NotImplementedError) as refused:
        pipeline_spec_for(tf.ElectraForMaskedLM(config))
    message = str(refused.value)
    assert "its tiny copy (its config scaled down) has no electra.embeddings_project" in message, message
    assert "add its module" not in message, message
