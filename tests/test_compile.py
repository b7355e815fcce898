"""torch.compile of a sharded model computes what the unsharded model computes (tp=2, one spawn).

dynamo traces the sharded forward (backend "eager": the graph capture, not the code generation, is
where a sharded model can go wrong, and it compiles in seconds): loss and every gathered gradient
equal the unsharded model's. An earlier module-level cache for q/k/v's shared input copy was baked
stale into the trace and gave BERT a wrong loss (4.28 for 4.63) with no error.
"""

import torch
import transformers as tf

from shardformer import ShardConfig, shard_model
from tests.helpers import assert_close, assert_grads_match, check_table
from tests.policies import zoo


def _compiled_matches_unsharded(model_class, config):
    torch.manual_seed(0)
    ref = model_class(config).train()
    torch.manual_seed(0)
    model = model_class(config).train()
    ids = torch.randint(3, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    expected = ref(input_ids=ids, labels=ids).loss
    expected.backward()
    sharded = shard_model(model, ShardConfig(tensor_parallel_size=2))
    sharded(input_ids=ids, labels=ids).loss.detach()  # an eager call first, as a user's warm-up would be
    torch._dynamo.reset()
    loss = torch.compile(sharded, backend="eager")(input_ids=ids, labels=ids).loss
    loss.backward()
    assert_close(loss, expected, what=f"compiled {model_class.__name__} loss")
    assert_grads_match(sharded, ref, group=sharded.shardformer.tp_group)


def check_compiled_bert_mlm():
    _compiled_matches_unsharded(tf.BertForMaskedLM, zoo.bert_config())


def check_compiled_gpt2_lm():
    _compiled_matches_unsharded(tf.GPT2LMHeadModel, zoo.gpt2_config())


test_tp2 = check_table([check_compiled_bert_mlm, check_compiled_gpt2_lm], 2)
