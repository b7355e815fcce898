"""Collectives per training step of whole sharded models equal Megatron's minimum (ratio 1.00).

Per transformer layer: 2 all-reduces forward (attention and MLP row layers) and 2 backward
(attention and MLP column inputs); plus 1 forward for the vocab-parallel embedding, 1 backward for
the LM head's input, and the loss's 3 small all-reduces. Nothing else.
"""

import torch.distributed as dist

from shardformer import ShardConfig, shard_model
from shardformer.layers import CollectiveCounter
from tests.helpers import check_table
from tests.policies import zoo


def _count(name):
    _, model = zoo.load_twice(name)
    model = shard_model(model, ShardConfig(tensor_parallel_size=dist.get_world_size()))
    inputs = zoo.inputs_for(name)
    with CollectiveCounter() as fwd:
        out = model(**inputs)
    with CollectiveCounter() as bwd:
        out.loss.backward()
    return model.config, fwd, bwd


def _check_minimum(name, has_vocab):
    config, fwd, bwd = _count(name)
    layers = config.num_hidden_layers
    minimum_fwd = 2 * layers + (1 + 3 if has_vocab else 0)  # + embedding + loss
    minimum_bwd = 2 * layers + (1 if has_vocab else 0)  # + LM head input
    assert set(fwd.counts) <= {"all_reduce"} and set(bwd.counts) <= {"all_reduce"}, (fwd.counts, bwd.counts)
    ratio = (len(fwd.calls) + len(bwd.calls)) / (minimum_fwd + minimum_bwd)
    assert (len(fwd.calls), len(bwd.calls)) == (minimum_fwd, minimum_bwd), (
        f"{name}: {len(fwd.calls)} forward / {len(bwd.calls)} backward collectives, minimum "
        f"{minimum_fwd} / {minimum_bwd} (ratio {ratio:.2f})"
    )


def check_gpt2_lm_head_minimum_collectives():
    _check_minimum("GPT2LMHeadModel", has_vocab=True)


def check_bert_mlm_minimum_collectives():
    _check_minimum("BertForMaskedLM", has_vocab=True)


def check_vit_classifier_minimum_collectives():
    _check_minimum("ViTForImageClassification", has_vocab=False)


test_tp2 = check_table(
    [
        check_gpt2_lm_head_minimum_collectives,
        check_bert_mlm_minimum_collectives,
        check_vit_classifier_minimum_collectives,
    ],
    2,
)
