"""Positions past a model's learned position table are refused naming the input, the limit and the fix
(the unsharded model: torch's bare "index out of range in self"): a forward too long, a generate() that
runs past the table; on every rank alike at tp=2 and at cp=2, where each rank holds other positions and
only one of them would have read past the table, and at pp=2, where only the first stage holds it. Models whose positions have no table (rotary, offset
tables with their own forward) get no check.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import transformers as tf

from shardformer import ShardConfig, shard_model
from shardformer.core.position_limit import position_tables
from shardformer.core.tiny import tiny_config
from shardformer.tools.pair_check import load_pair
from tests.helpers import assert_close, check_table

POSITIONS = 16
GPT2 = dict(n_positions=POSITIONS, bos_token_id=0, eos_token_id=0)
MESSAGE = (
    rf"position ids outside the {POSITIONS} positions of transformer.wpe \(\[0, {POSITIONS}\)\): 16, 17, 18, 19 "
    rf"\(\d+ of \d+\); GPT2LMHeadModel takes at most config.n_positions = {POSITIONS} positions"
)


def _gpt2(**shard):
    config = tiny_config(tf.GPT2Config, **GPT2)
    if dist.is_initialized():
        ref, model = load_pair(tf.GPT2LMHeadModel, config)
    else:
        torch.manual_seed(0)
        ref = tf.GPT2LMHeadModel(config)
        model = copy.deepcopy(ref)
    return ref, shard_model(model, ShardConfig(**shard))


def _ids(seq: int) -> torch.Tensor:
    return torch.randint(3, 99, (2, seq), generator=torch.Generator().manual_seed(seq))


def _refused(call) -> str:
    with pytest.raises(IndexError, match=MESSAGE) as info:
        call()
    return str(info.value)


def test_a_sequence_past_the_position_table_names_the_limit_and_the_fix():
    ref, model = _gpt2()
    with pytest.raises(IndexError, match="index out of range in self"):  # what the unsharded model says
        ref(input_ids=_ids(POSITIONS + 4))
    message = _refused(lambda: model(input_ids=_ids(POSITIONS + 4)))
    assert f"tokenizer(..., truncation=True, max_length={POSITIONS})" in message
    assert f"with generate() keep the prompt plus max_new_tokens within {POSITIONS}" in message
    ids = _ids(POSITIONS)
    assert_close(model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss, what="at the limit")


def test_generate_past_the_position_table_is_refused_at_the_first_position_past_it():
    _, model = _gpt2()
    model.eval()
    prompt = _ids(POSITIONS - 2)[:1]
    # the last new token is never read back: 14 + 3 tokens read positions 0..15
    assert model.generate(prompt, max_new_tokens=3, do_sample=False).shape == (1, POSITIONS + 1)
    with pytest.raises(IndexError, match=rf"position ids outside the {POSITIONS} positions of transformer.wpe"):
        model.generate(prompt, max_new_tokens=4, do_sample=False)


def test_the_tables_found_are_the_learned_position_embeddings():
    def tables(cls, config_cls, **config):
        model = shard_model(cls(tiny_config(config_cls, **config)), ShardConfig())
        return [(t.path, t.size, t.setting) for t in position_tables(model)]

    assert tables(tf.GPT2LMHeadModel, tf.GPT2Config, **GPT2) == [("transformer.wpe", 16, "config.n_positions")]
    bert = tables(tf.BertForMaskedLM, tf.BertConfig, max_position_embeddings=32)
    assert bert == [("bert.embeddings.position_embeddings", 32, "config.max_position_embeddings")]  # not token types
    assert tables(tf.LlamaForCausalLM, tf.LlamaConfig) == []  # rotary: no table
    assert tables(tf.OPTForCausalLM, tf.OPTConfig) == []  # an offset table with its own forward


def check_every_tensor_parallel_rank_raises_alike():
    _, model = _gpt2(tensor_parallel_size=2)
    _refused(lambda: model(input_ids=_ids(POSITIONS + 4)))
    ids = _ids(POSITIONS)
    model(input_ids=ids, labels=ids).loss.backward()  # nothing was left waiting: the next forward runs


def check_every_context_parallel_rank_raises_before_the_split():
    ref, model = _gpt2(context_parallel_size=2)
    # 20 tokens in 4 chunks of 5: rank 0 holds 0-4 and 15-19, rank 1 holds 5-14, all inside the table;
    # rank 1 would have gone on into the attention's collectives and waited there
    _refused(lambda: model(input_ids=_ids(POSITIONS + 4)))
    ids = _ids(POSITIONS)
    assert_close(model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss, what="cp at the limit")
    assert dist.get_world_size() == 2


def check_every_pipeline_stage_raises_before_the_first_send():
    """Only the first stage holds the table: the engine checks the batch's positions on every stage."""
    from shardformer import EngineConfig, ParallelEngine

    _, model = load_pair(tf.GPT2LMHeadModel, tiny_config(tf.GPT2Config, **GPT2))
    engine = ParallelEngine(model, lambda p: torch.optim.SGD(p, lr=0.1), EngineConfig(pp=2, num_microbatches=2))
    assert engine.mesh.pp_size == 2 and engine.model.shardformer.layers is not None
    ids = _ids(POSITIONS + 4)
    _refused(lambda: engine.train_step({"input_ids": ids, "labels": ids}))
    ids = _ids(POSITIONS)
    assert engine.train_step({"input_ids": ids, "labels": ids}) > 0  # nothing was left waiting


test_two_ranks = check_table(
    [
        check_every_tensor_parallel_rank_raises_alike,
        check_every_context_parallel_rank_raises_before_the_split,
        check_every_pipeline_stage_raises_before_the_first_send,
    ],
    2,
)
