"""PEFT LoRA layers cannot be sharded yet: a LoRA-wrapped model is refused before any collective,
never sharded with its wrapped projections left whole."""

import pytest
from peft import LoraConfig, get_peft_model

from shardformer import ShardConfig, shard_model
from tests.integrations.common import tiny_gpt2


@pytest.mark.parametrize("unwrap", [False, True], ids=["peft_model", "its_base_model"])
def test_lora_wrapped_model_is_refused_before_sharding(unwrap):
    model = get_peft_model(tiny_gpt2(), LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    target = model.base_model.model if unwrap else model
    with pytest.raises(ValueError, match="PEFT adapter layers .*c_attn"):
        shard_model(target, ShardConfig(tensor_parallel_size=2))
