"""Bad input fails before any process group exists, naming the value and the fix."""

import logging

import pytest
import torch.nn as nn
from transformers import GPT2Model

from shardformer import Argument, Col_Layer, Policy, ShardConfig, shard_model, sharding_of
from shardformer.tensor_parallel.policy import Row_Layer
from tests.policies import zoo


class _Gpt2BlockPolicy(Policy):
    def __init__(self, *layers):
        self.layers = list(layers)

    def argument_policy(self, config, shard_config):
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        return {GPT2Block: Argument({}, [lambda: self.layers])}


def test_model_without_blocks_is_pointed_at_a_policy_or_data_parallelism():
    # no stack of blocks to derive a cut from, but projections a Policy could name: both fixes, first
    with pytest.raises(
        ValueError, match=r"^Write your own Policy subclass .*policy=MyPolicy.*; or train it with data "
    ):
        shard_model(nn.Sequential(nn.Linear(2, 2)), ShardConfig(tensor_parallel_size=2))


def test_model_no_route_applies_to_names_the_supported_classes():
    from shardformer.policies.routes import no_route_error

    error = no_route_error(nn.Sequential(nn.Linear(2, 2)))
    assert str(error).startswith("Write your own Policy subclass"), error
    assert "no built-in policy for Sequential; supported: " in str(error) and "BertForMaskedLM" in str(error), error


def test_quantization_aware_layers_are_named_with_data_parallelism_first():
    """IBert's matrices sit in QuantLinear / QuantEmbedding (F.linear on their own weight), which no cut
    layer stands in for: the refusal names the classes and a path, and points at data parallelism."""
    from transformers import IBertConfig, IBertForMaskedLM

    from shardformer.policies.routes import no_route_error

    config = IBertConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
    )
    error = str(no_route_error(IBertForMaskedLM(config)))
    assert error.startswith("Train it with data parallelism"), error
    assert "QuantLinear (ibert.encoder.layer.0.attention.self.query)" in error and "QuantEmbedding" in error, error


def test_heads_that_tp_does_not_divide_are_named():
    with pytest.raises(
        ValueError, match=r"num_attention_heads=4 is not divisible by tensor_parallel_size=3.*\[1, 2, 4\]"
    ):
        shard_model(GPT2Model(zoo.gpt2_config()), ShardConfig(tensor_parallel_size=3))


def test_missing_suffix_names_suffix_and_module():
    policy = _Gpt2BlockPolicy(Col_Layer("attn.c_atn", reversed=True))
    with pytest.raises(ValueError, match=r"suffix 'attn.c_atn' is not in GPT2Block \(h.0\).*ignore=True"):
        shard_model(GPT2Model(zoo.gpt2_config()), ShardConfig(), policy=policy)


def test_ignored_missing_suffix_is_skipped():
    policy = _Gpt2BlockPolicy(
        Col_Layer("attn.q_attn", reversed=True, ignore=True), Row_Layer("mlp.c_proj", reversed=True)
    )
    model = shard_model(GPT2Model(zoo.gpt2_config()), ShardConfig(), policy=policy)
    assert type(model.h[0].mlp.c_proj).__name__ == "Linear1D_Row"


def test_conv1d_without_reversed_is_caught():
    policy = _Gpt2BlockPolicy(Col_Layer("attn.c_attn", n_cast=3))
    with pytest.raises(ValueError, match=r"h.0.attn.c_attn is Conv1D \(weight \[in, out\]\).*set reversed=True"):
        shard_model(GPT2Model(zoo.gpt2_config()), ShardConfig(), policy=policy)


def test_tp_without_processes_says_how_to_launch():
    with pytest.raises(RuntimeError, match=r"tensor_parallel_size=2 .* needs that many processes.*shardformer run"):
        shard_model(GPT2Model(zoo.gpt2_config()), ShardConfig(tensor_parallel_size=2))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tensor_parallel_size": 0}, r"tensor_parallel_size=0 must be a positive integer"),
        ({"pipeline_parallel_size": 1.5}, r"pipeline_parallel_size=1.5 must be a positive integer"),
        ({"data_parallel_size": 0}, r"data_parallel_size=0 must be a positive integer or None"),
        ({"gather_output": "yes"}, r"gather_output='yes' must be True or False"),
        ({"overlap_communication": 1}, r"overlap_communication=1 must be True or False"),
        ({"vocab_pad_multiple": 0}, r"vocab_pad_multiple=0 must be a positive integer"),
    ],
)
def test_shard_config_checks_itself(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ShardConfig(**kwargs)


def test_policy_for_classes_the_model_lacks():
    class WrongPolicy(Policy):
        def argument_policy(self, config, shard_config):
            return {nn.GRU: Argument({}, [])}

    with pytest.raises(ValueError, match=r"names the module classes \['GRU'\], but GPT2Model contains none"):
        shard_model(GPT2Model(zoo.gpt2_config()), ShardConfig(), policy=WrongPolicy())


def test_one_process_tp1_sharding_is_the_identity_on_values():
    import torch

    torch.manual_seed(0)
    model = GPT2Model(zoo.gpt2_config()).eval()
    ids = torch.randint(0, zoo.VOCAB, (2, 5))
    expected = model(ids).last_hidden_state
    sharded = shard_model(model, ShardConfig())
    torch.testing.assert_close(sharded(ids).last_hidden_state, expected)


def test_sharding_twice_is_refused_and_an_unsharded_model_has_no_record():
    model = GPT2Model(zoo.gpt2_config())
    with pytest.raises(ValueError, match="was not sharded by shardformer"):
        sharding_of(model)
    shard_model(model, ShardConfig())
    info = sharding_of(model)
    assert (info.stage, info.num_stages, info.layers, info.mesh) == (0, 1, None, None)
    assert info.shard_config.tensor_parallel_size == 1 and type(info.policy).__name__ == "GPT2Policy"
    with pytest.raises(ValueError, match="already sharded.*shard the original model instead"):
        shard_model(model, ShardConfig())


def test_sharding_logs_a_summary_at_info(caplog):
    with caplog.at_level(logging.INFO, logger="shardformer"):
        shard_model(GPT2Model(zoo.gpt2_config()), ShardConfig())
    (record,) = [r for r in caplog.records if r.name == "shardformer"]
    assert record.getMessage().startswith(
        "sharded GPT2Model with GPT2Policy at tp=1: nothing is cut, this rank holds all "
    )
    assert "Linear1D_Col" not in record.getMessage()  # swapped in, but nothing is cut: not listed as replaced
