"""Collectives per training step and per decoded token of whole sharded models equal Megatron's minimum.

Per transformer layer: 2 all-reduces forward (attention and MLP row layers) and 2 backward
(attention and MLP column inputs); plus 1 forward for the vocab-parallel embedding, 1 backward for
the LM head's input, and the loss's 3 small all-reduces. Nothing else.

Greedy decoding with the KV cache, per token: the embedding's all-reduce, 2 all-reduces per layer
and the LM head's one all-gather of the last position's logits; no broadcast of the chosen token.
"""

import torch
import torch.distributed as dist
import transformers as tf

from shardformer import ShardConfig, shard_model
from shardformer.core.tiny import tiny_config
from shardformer.tensor_parallel.layers import CollectiveCounter
from shardformer.tools.pair_check import load_pair
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


def _decode_collectives(ref, model, new_tokens=4):
    """Collectives of one decoded token (generate with new_tokens minus generate with 1, the prefill),
    after checking that greedy tokens equal the unsharded model's."""
    ids = torch.randint(3, zoo.VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    kwargs = {"do_sample": False, "pad_token_id": 0, "attention_mask": torch.ones_like(ids)}
    calls = {}
    for n in (1, new_tokens):
        with CollectiveCounter() as counter:
            tokens = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        assert torch.equal(tokens, ref.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)), n
        calls[n] = counter.counts
    per_token = calls[new_tokens] - calls[1]
    return {op: count / (new_tokens - 1) for op, count in per_token.items()}


def check_greedy_decode_minimum_collectives_gpt2_and_derived_llama():
    gpt2 = zoo.load_twice("GPT2LMHeadModel")
    llama = load_pair(tf.LlamaForCausalLM, tiny_config(tf.LlamaConfig))
    for ref, model in (gpt2, llama):
        model = shard_model(model.eval(), ShardConfig(tensor_parallel_size=dist.get_world_size()))
        per_token = _decode_collectives(ref.eval(), model)
        minimum = {"all_reduce": 1 + 2 * model.config.num_hidden_layers, "all_gather": 1}
        assert per_token == minimum, f"{type(model).__name__}: {per_token} per decoded token, minimum {minimum}"


test_tp2 = check_table(
    [
        check_greedy_decode_minimum_collectives_gpt2_and_derived_llama,
        check_gpt2_lm_head_minimum_collectives,
        check_bert_mlm_minimum_collectives,
        check_vit_classifier_minimum_collectives,
    ],
    2,
)
