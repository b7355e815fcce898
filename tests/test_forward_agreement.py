"""A sharded model's own forward, driven by a user's loop, on 2 ranks (one spawn):

- it keeps the model's signature on every route (built-in GPT-2 and BERT, Llama from its tp plan,
  derived OPT and T5, context parallelism), which transformers' Trainer reads to filter batch columns,
  and takes labels given by position as the model does;
- tensor- or context-parallel peers given different batches (other values, other lengths) raise the
  same clear error on every rank before any collective of the forward (cp ranks given different
  lengths used to die in a gloo SIGABRT), on every forward: forward 5 after four agreeing ones, and
  after three refused ones (the old schedule, forwards 1-3 then every 100th, missed both: one shared
  wrong loss, or an abort); the same batch stays exact, and generate and eval run as before;
  ``forward_agreement_every=N`` compares every N-th forward that returned (a refused one uses up
  nothing) and ranks given different N are refused. Under ParallelEngine the forward compares shapes
  only: the engine's own step agreement compares the values.
(tp=2 x cp=2 on 4 ranks: tests/context_parallel/test_engine.py.)
"""

import inspect

import pytest
import torch
import torch.distributed as dist
import transformers as tf

from shardformer import EngineConfig, ParallelEngine, ShardConfig, shard_model
from shardformer.core.tiny import tiny_config
from shardformer.tools.pair_check import load_pair
from tests.helpers import assert_close, check_table

VOCAB = 99  # tiny_config's vocabulary


def _pair(cls, config_cls, config=None, **shard):
    ref, model = load_pair(cls, tiny_config(config_cls, **(config or {})))
    return ref, shard_model(model, ShardConfig(**shard))


def _batch(seed, seq=8, rows=2):
    ids = torch.randint(3, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _assert_original_signature(model, cls, what):
    original = inspect.signature(cls.forward)
    original = original.replace(parameters=list(original.parameters.values())[1:])  # bound: no self
    assert inspect.signature(model.forward) == original, f"{what}: {inspect.signature(model.forward)}"


def check_forward_keeps_its_signature_on_every_route():
    routes = [
        (tf.GPT2LMHeadModel, tf.GPT2Config, "GPT2LMHeadPolicy"),
        (tf.BertForMaskedLM, tf.BertConfig, "BertForMaskedLMPolicy"),  # its own forward (inline loss)
        (tf.LlamaForCausalLM, tf.LlamaConfig, "TpPlanPolicy"),
        (tf.OPTForCausalLM, tf.OPTConfig, "DerivedPolicy"),
        (tf.T5ForConditionalGeneration, tf.T5Config, "DerivedPolicy"),  # vocab-parallel seq2seq loss
    ]
    for cls, config_cls, policy in routes:
        config = {"decoder_start_token_id": 0} if cls is tf.T5ForConditionalGeneration else None
        ref, model = _pair(cls, config_cls, config, tensor_parallel_size=2)
        assert type(model.shardformer.policy).__name__ == policy, (cls.__name__, model.shardformer.policy)
        _assert_original_signature(model, cls, f"{cls.__name__} ({policy})")
        if cls in (tf.BertForMaskedLM, tf.T5ForConditionalGeneration):  # labels by position, as unsharded
            batch = _batch(0)
            position = list(inspect.signature(cls.forward).parameters).index("labels") - 1
            args = [batch["input_ids"]] + [None] * (position - 1) + [batch["labels"]]
            assert_close(model(*args).loss, ref(*args).loss, what=f"{cls.__name__} with positional labels")
    _, model = _pair(tf.LlamaForCausalLM, tf.LlamaConfig, context_parallel_size=2)
    _assert_original_signature(model, tf.LlamaForCausalLM, "LlamaForCausalLM at cp=2")


def _refused(model, batch, *patterns):
    with pytest.raises(RuntimeError) as info:
        model(**batch)
    for pattern in patterns:
        assert pattern in str(info.value), f"{pattern!r} not in: {info.value}"


FIX = "split the data over the data-parallel ranks only, e.g. DistributedSampler("


def check_tensor_parallel_ranks_given_different_batches_raise():
    ref, model = _pair(tf.GPT2LMHeadModel, tf.GPT2Config, tensor_parallel_size=2)
    rank = dist.get_rank()
    same = _batch(0)
    for _ in range(4):  # a few agreeing forwards (evaluation calls, say) before the user's loop starts
        assert_close(model(**same).loss, ref(**same).loss, what="the same batch on both ranks")
    peers = "ranks 0, 1 are tensor-parallel peers and must run the same batch, but forward #5"
    _refused(model, _batch(rank), peers, "input_ids (same shape [2, 8], other values); labels (same", FIX)
    lengths = "input_ids (rank 0: [2, 8] int64, rank 1: [2, 12] int64)"  # gloo used to abort (SIGABRT)
    _refused(model, _batch(0, seq=8 + 4 * rank), "forward #6", lengths)
    assert_close(model(**same).loss, ref(**same).loss, what="after the refusals")
    model.eval(), ref.eval()
    agreement = model.shardformer.forward_agreement
    agreement.calls["tp"] = 0  # generate's forwards are checked too (each step's inputs agree)
    prompt = same["input_ids"][:1, :4]
    tokens = model.generate(prompt, max_new_tokens=5, do_sample=False)
    assert torch.equal(tokens, ref.generate(prompt, max_new_tokens=5, do_sample=False))
    assert agreement.calls["tp"] == 5
    with torch.no_grad():
        assert_close(model(**same).loss, ref(**same).loss, what="eval")


def _bad_ids(model):
    """The same batch on both ranks with a token id past the vocabulary: refused inside the forward."""
    with pytest.raises(IndexError, match="outside the vocabulary"):
        model(input_ids=torch.full((2, 8), VOCAB + 5))


def check_refused_forwards_use_up_nothing():
    _, model = _pair(tf.GPT2LMHeadModel, tf.GPT2Config, tensor_parallel_size=2)
    rank = dist.get_rank()
    for _ in range(3):
        _bad_ids(model)
    _refused(model, _batch(rank), "forward #4 got different inputs: input_ids (same shape [2, 8], other values)")
    # a lower frequency, asked for: forwards 1 and 3 compared (after 0 and 2 that returned), 2 not; the
    # refused 3rd leaves the count at 2, so the 4th is compared too
    _, model = _pair(tf.GPT2LMHeadModel, tf.GPT2Config, tensor_parallel_size=2, forward_agreement_every=2)
    agreement = model.shardformer.forward_agreement
    compared, check = [], agreement.check
    agreement.check = lambda model, inputs, group, count: (compared.append(count), check(model, inputs, group, count))
    model(**_batch(0)), model(**_batch(0))
    _bad_ids(model)
    _refused(model, _batch(rank), "forward #4 got different inputs")
    assert compared == [1, 3, 4] and agreement.returned["tp"] == 2, (compared, agreement.returned)
    with pytest.raises(ValueError, match="forward_agreement_every=0 must be a positive integer"):
        ShardConfig(tensor_parallel_size=2, forward_agreement_every=0)
    _, model = _pair(tf.GPT2LMHeadModel, tf.GPT2Config, tensor_parallel_size=2, forward_agreement_every=1 + rank)
    with pytest.raises(ValueError, match=r"forward_agreement_every differs .* \(rank 0: 1, rank 1: 2\)"):
        model(**_batch(0))


def check_context_parallel_ranks_given_different_batches_raise():
    for mode in ("ring", "all_to_all"):
        ref, model = _pair(tf.LlamaForCausalLM, tf.LlamaConfig, context_parallel_size=2, context_parallel_mode=mode)
        rank = dist.get_rank()
        same = _batch(0, seq=10)
        assert_close(model(**same).loss, ref(**same).loss, what=f"{mode}: the same batch on both ranks")
        peers = "ranks 0, 1 are context-parallel peers and must run the same batch, but forward #2"
        lengths = "input_ids (rank 0: [2, 8] int64, rank 1: [2, 13] int64)"  # gloo used to abort (SIGABRT)
        _refused(model, _batch(0, seq=8 + 5 * rank), peers, lengths, "abort inside the collective library", FIX)
        _refused(model, _batch(rank), "forward #3", "input_ids (same shape [2, 8], other values)")
        assert_close(model(**same).loss, ref(**same).loss, what=f"{mode}: after the refusals")
        model.eval(), ref.eval()
        prompt = same["input_ids"][:1, :4]  # generate's forwards with a cache run whole: not compared
        tokens = model.generate(prompt, max_new_tokens=3, do_sample=False)
        assert torch.equal(tokens, ref.generate(prompt, max_new_tokens=3, do_sample=False))


def check_engine_forward_compares_shapes_its_steps_compare_values():
    _, model = load_pair(tf.GPT2LMHeadModel, tiny_config(tf.GPT2Config))
    engine = ParallelEngine(model, lambda p: torch.optim.SGD(p, lr=0.1), EngineConfig(tp=2))
    rank = dist.get_rank()
    engine.train_step(_batch(0))
    with pytest.raises(RuntimeError, match=r"ranks 0, 1 must get the same batch"):  # the step's check
        engine.train_step(_batch(rank))
    with pytest.raises(RuntimeError, match=r"input_ids \(rank 0: \[2, 8\] int64, rank 1: \[2, 9\] int64\)"):
        engine.train_step(_batch(0, seq=8 + rank))  # the forward's, before any collective of the forward


test_two_ranks = check_table(
    [
        check_forward_keeps_its_signature_on_every_route,
        check_tensor_parallel_ranks_given_different_batches_raise,
        check_refused_forwards_use_up_nothing,
        check_context_parallel_ranks_given_different_batches_raise,
        check_engine_forward_compares_shapes_its_steps_compare_values,
    ],
    2,
)
