"""Refusals say what to do on their first line, print each reason once, and offer a Policy only
where one can help (not for convolutions or head counts; a state-space mixer's groups tp does not
divide: tests/policies/test_mamba.py). All refused before any
process group exists: one process."""

import traceback

import pytest
import torch
import torch.nn as nn
import transformers as tf

from shardformer import Col_Layer, Row_Layer, ShardConfig, shard_model
from shardformer.tensor_parallel.policy import Argument, Policy
from tests.policies.plain_models import TorchEncoderLM

POLICY = "Policy subclass"


class _Block(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class MaskedLM(nn.Module):
    """A plain module whose forward takes a second argument with no default."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, tokens, mask):
        h = self.embed(tokens) * mask[..., None]
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class _BlockPolicy(Policy):
    def argument_policy(self, config, shard_config):
        return {_Block: Argument({}, [lambda: [Col_Layer("up"), Row_Layer("down")]])}


def _refusal(model: nn.Module, tp: int = 2) -> tuple[str, str]:
    """The refusal's message and its whole printed traceback (with any chained errors)."""
    with pytest.raises(ValueError) as info:
        shard_model(model, ShardConfig(tensor_parallel_size=tp))
    return str(info.value), "".join(traceback.format_exception(info.value))


def _printed_once(message: str, printed: str) -> None:
    for line in filter(None, (line.strip() for line in message.splitlines())):
        assert printed.count(line) == 1, f"printed {printed.count(line)} times: {line}\n{printed}"


def test_a_second_required_argument_is_named_with_its_fix():
    message, printed = _refusal(MaskedLM())
    first = message.splitlines()[0]
    assert "example_inputs={'tokens': tensor, 'mask': tensor}" in first, message
    assert "give MaskedLM.forward's 'mask' a default (def forward(self, tokens, mask=None))" in first, message
    assert POLICY in first, message  # a Policy subclass is not proven on a copy: it needs no inputs
    assert "requires 'mask'" in message and "MViT" not in message, message
    _printed_once(message, printed)

    class Defaulted(MaskedLM):
        def forward(self, tokens, mask=None):
            return super().forward(tokens, torch.ones_like(tokens) if mask is None else mask)

    # both fixes the message offers get past the refusal, to the launch itself (no processes here)
    tokens = torch.randint(0, 8, (2, 8))
    given = {"tokens": tokens, "mask": torch.ones_like(tokens)}
    for model, policy, inputs in (
        (Defaulted(), None, None),
        (MaskedLM(), _BlockPolicy(), None),
        (MaskedLM(), None, given),
    ):
        with pytest.raises(RuntimeError, match="needs that many processes"):
            shard_model(model, ShardConfig(tensor_parallel_size=2, example_inputs=inputs), policy=policy)


class _ThreeHeads(TorchEncoderLM):
    def __init__(self) -> None:
        super().__init__(dim=24)
        layer = nn.TransformerEncoderLayer(24, 3, 48, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def test_heads_that_tp_does_not_divide_point_at_the_size_not_a_policy():
    # torch's nn.MultiheadAttention with 3 heads (a head count found by simulation: test_plain's EVA-02)
    message, printed = _refusal(_ThreeHeads())
    first = message.splitlines()[0]
    assert first.startswith("Use a tensor_parallel_size that divides the head counts"), message
    assert "self_attn is torch's nn.MultiheadAttention, and its 3 heads do not split" in message, message
    assert POLICY not in message, message
    _printed_once(message, printed)
    llama = tf.LlamaConfig(
        hidden_size=48, intermediate_size=64, num_attention_heads=3, num_key_value_heads=3, num_hidden_layers=2,
        vocab_size=64,
    )  # fmt: skip
    message, _ = _refusal(tf.LlamaForCausalLM(llama))
    assert "use a tensor_parallel_size that divides it: [1, 3]" in message.splitlines()[0], message
    assert POLICY not in message, message


@pytest.mark.parametrize("name", ["plain", "transformers BiT"])
def test_convolutions_no_channel_cut_computes_point_at_data_parallelism(name):
    """Convolutional networks are cut over channels where exact (ResNet: tests/policies/test_derived.py);
    one whose every convolution's channels are read across them (group norms, a flatten) is refused."""
    from tests.policies.plain_models import conv_net

    models = {
        "plain": lambda: conv_net(cut=False),
        "transformers BiT": lambda: tf.BitModel(tf.BitConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_groups=4)),
    }  # fmt: skip
    message, printed = _refusal(models[name]())
    assert message.startswith("Train it with data parallelism and ZeRO (EngineConfig(dp=..."), message
    assert "group_norm reads them" in message and POLICY not in message, message
    _printed_once(message, printed)


def test_a_model_refused_on_every_route_prints_each_reason_and_the_fix_once():
    config = tf.DogeConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        vocab_size=64,
    )  # fmt: skip
    message, printed = _refusal(tf.DogeForCausalLM(config))
    lines = message.splitlines()
    assert lines[0].startswith("Write your own Policy subclass and pass it"), message
    assert message.count(POLICY) == 1 and message.count("docs/writing-a-policy.md") == 1, message
    assert "Routes tried:" in lines[1], message
    assert lines[2].startswith("  tp plan: model.layers.0.self_attn (DogeAttention) holds parameters"), message
    assert lines[3].startswith("  derived: no exact cut of DogeForCausalLM"), message
    # the module and the reason, not the error the candidate cut raised
    assert "self_attn.dt_proj (Linear) reads every head's features" in message, message
    assert "RuntimeError" not in message, message
    _printed_once(message, printed)


def test_a_statistic_over_the_cut_features_is_named():
    """Gemma 3n's MLP sparsifies its gate by a cutoff ``mean + std * k`` over the gate's whole width, in its own
    forward: the refusal names the statistics and the width the column cut splits (no layer reduces them)."""
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nTextMLP

    from shardformer.policies.derived.feature_norms import own_statistics

    config = tf.Gemma3nTextConfig(
        hidden_size=16, intermediate_size=64, num_hidden_layers=1, layer_types=["full_attention"]
    )
    config.activation_sparsity_pattern = [0.95]
    mlp, x = Gemma3nTextMLP(config, layer_idx=0), torch.randn(2, 4, 16)
    why = own_statistics(mlp, (x,), {}, {64})
    assert "Gemma3nTextMLP's own forward takes the mean over 64, the std over 64 features" in str(why), why
    config.activation_sparsity_pattern = [0.0]
    assert own_statistics(Gemma3nTextMLP(config, layer_idx=0), (x,), {}, {64}) is None  # no sparsity: none taken
