"""torch.compile of a sharded model: no extra graph breaks, and what the unsharded model computes (tp=2, one spawn).

For each family (GPT-2 LM, a Llama sharded by the policy derived from its tp plan) dynamo's graphs of the unsharded model are counted (backend "eager": capture only), then
the sharded model runs compiled with "aot_eager", which traces the backward as well (where an
autograd function's collectives must be traceable too): no more graphs than the unsharded model,
and loss and every gathered gradient equal to the unsharded model's eager ones. An earlier
module-level cache for q/k/v's shared input copy was baked stale into the trace and gave BERT a
wrong loss (4.28 for 4.63) with no error; the Llama (separate q, k, v reading one input) runs eager once
first to catch such a cache. The
engine's compile path is checked once against one process training the unsharded model. The Llama
runs with sequence parallelism (its sequence collectives must trace as well).
"""

import torch
import transformers as tf
from torch._dynamo.testing import CompileCounterWithBackend

from shardformer import ShardConfig, shard_model
from shardformer.core.tiny import tiny_config
from tests.helpers import assert_close, assert_grads_match, check_table
from tests.pipeline.test_engine import _check as engine_check
from tests.policies import zoo


def _graphs_and_loss(model, inputs, backend):
    """(graphs dynamo made, loss) of one compiled training forward."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    loss = torch.compile(model, backend=counter)(**inputs).loss
    return counter.frame_count, loss


def _compiled_matches_unsharded(model_class, config, inputs=None, warm_up=False, sequence_parallel=False):
    inputs = inputs or _token_inputs(config)
    torch.manual_seed(0)
    ref = model_class(config).train()
    torch.manual_seed(0)
    model = model_class(config).train()
    expected = ref(**inputs).loss
    expected.backward()
    ref_graphs, _ = _graphs_and_loss(ref, inputs, "eager")
    sharded = shard_model(model, ShardConfig(tensor_parallel_size=2, sequence_parallel=sequence_parallel))
    if warm_up:
        sharded(**inputs).loss.detach()  # an eager call first, as a user's warm-up would be
    graphs, loss = _graphs_and_loss(sharded, inputs, "aot_eager")
    loss.backward()
    name = model_class.__name__
    # GPT-2's own loss path breaks once (transformers' loss_type warning); the vocab-parallel loss does not
    assert graphs <= ref_graphs, f"compiled {name}: {graphs} graphs sharded, {ref_graphs} unsharded"
    assert_close(loss, expected, what=f"compiled {name} loss")
    assert_grads_match(sharded, ref, group=sharded.shardformer.tp_group)


def _token_inputs(config):
    ids = torch.randint(3, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def check_compiled_gpt2_lm():
    _compiled_matches_unsharded(tf.GPT2LMHeadModel, zoo.gpt2_config())


def check_compiled_llama_from_its_tp_plan_with_sequence_parallelism():
    # the plan route, its sequence collectives traced too
    _compiled_matches_unsharded(tf.LlamaForCausalLM, tiny_config(tf.LlamaConfig), warm_up=True, sequence_parallel=True)


def check_engine_compiles_its_stage():
    """EngineConfig(compile=True) at tp=2: losses of 3 steps and the weights after them as unsharded."""
    torch._dynamo.reset()
    engine = engine_check("GPT2LMHeadModel", 2, 1, 1, "1f1b", 1, None, compile=True, compile_backend="aot_eager")
    assert hasattr(engine.stage_forward, "_torchdynamo_orig_callable"), "the stage forward was not compiled"


test_tp2 = check_table(
    [
        check_compiled_gpt2_lm,
        check_compiled_llama_from_its_tp_plan_with_sequence_parallelism,
        check_engine_compiles_its_stage,
    ],
    2,
)
