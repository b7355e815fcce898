"""Plan-derived models through ParallelEngine on 4 gloo ranks: pp=2 x tp=2 with ZeRO, cut by the
policy and pipeline spec derived from transformers' own tp / pp plans, against one process training
the unsharded model on the same batches (loss of every step, weights after the steps). One spawn.
"""

import torch
import transformers as tf

from shardformer.core.tiny import tiny_config
from shardformer.policies.anatomy_pipeline import AnatomyStageForward, pipeline_spec_for
from shardformer.tools.pair_check import load_pair
from tests.helpers import check_table
from tests.pipeline import common
from tests.pipeline.test_engine import STEPS, _check


def _run(name, combo, zero_stage=1, engine_options=None, **config):
    cls = getattr(tf, name)
    pair = load_pair(cls, tiny_config(cls.config_class, num_hidden_layers=common.LAYERS, **config))
    data = common.batches(name, STEPS)
    _check(name, *combo, zero_stage=zero_stage, model_pair=pair, data=data, **(engine_options or {}))


def check_llama_tp2_pp2_zero1_with_activation_checkpointing():
    """Exact with checkpointing; the last stage (no embedding) logs nothing about input embeddings."""
    import logging

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.Logger.warning_once.cache_clear()  # an earlier check may have logged it in this process
    logging.getLogger("transformers").addHandler(handler)
    try:
        _run("LlamaForCausalLM", (2, 2, 1, "1f1b", 2, 0.5, "torch"), engine_options={"activation_checkpointing": True})
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert not [m for m in seen if "input embeddings" in m], seen


def check_tied_llama_tp2_pp2_zero2():
    _run("LlamaForCausalLM", (2, 2, 1, "gpipe", 2, None, "p2p"), zero_stage=2, tie_word_embeddings=True)


def check_mixtral_tp2_pp2_zero1():
    _run("MixtralForCausalLM", (2, 2, 1, "1f1b", 2, None, "torch"))


def check_qwen3_tp2_pp2_zero1():  # q/k norm gradients summed over tp by hooks, under ZeRO and clipping
    _run("Qwen3ForCausalLM", (2, 2, 1, "gpipe", 2, 0.5, "p2p"))


def check_sequence_parallel_llama_tp2_pp2_zero2():  # norm gradients summed over tp, under ZeRO and clipping
    _run(
        "LlamaForCausalLM", (2, 2, 1, "1f1b", 2, 0.5, "torch"), zero_stage=2, engine_options={"sequence_parallel": True}
    )


def check_llama_sequence_classification_pp2_on_right_padded_batches():
    """The head pools the last real token: the last stage finds it from input_ids, as the model does."""
    cls = tf.LlamaForSequenceClassification
    pair = load_pair(cls, tiny_config(cls.config_class, num_hidden_layers=common.LAYERS, num_labels=3, pad_token_id=0))
    data = []
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        ids = torch.randint(3, 99, (common.BATCH, 8), generator=g)
        lengths = torch.randint(3, 9, (common.BATCH,), generator=g)
        mask = (torch.arange(8) < lengths[:, None]).long()  # right-padded with the pad token
        data.append(
            {
                "input_ids": ids * mask,
                "attention_mask": mask,
                "labels": torch.randint(0, 3, (common.BATCH,), generator=g),
            }
        )
    _check(cls.__name__, 2, 2, 1, "1f1b", 2, None, "torch", model_pair=pair, data=data)


def check_llama_question_answering_pp2_gets_its_span():
    """A QA head's targets (start and end positions) reach the last stage as labels do (it had no loss)."""
    cls = tf.LlamaForQuestionAnswering
    pair = load_pair(cls, tiny_config(cls.config_class, num_hidden_layers=common.LAYERS))
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(STEPS):
        start = torch.randint(0, 6, (common.BATCH,), generator=g)
        ids = torch.randint(3, 99, (common.BATCH, 8), generator=g)
        data.append({"input_ids": ids, "start_positions": start, "end_positions": start + 2})
    _check(cls.__name__, 2, 2, 1, "1f1b", 2, None, "torch", model_pair=pair, data=data)


def check_granite_with_its_multipliers_pp2_is_exact_through_the_anatomy_route():
    """Granite multiplies its embeddings by ``embedding_multiplier`` (12.0 in released checkpoints) inside
    its forward: the pp plan's stages miss it (the first step's loss was off, the embeddings drifted). Its
    proof on a tiny copy with these values refuses the plan, and the anatomy route is exact: the loss of
    two AdamW steps and every weight after them, against the unsharded model; saved and reloaded first."""
    cls, name = tf.GraniteForCausalLM, "GraniteForCausalLM"
    config = tiny_config(
        cls.config_class, num_hidden_layers=common.LAYERS, embedding_multiplier=12.0, residual_multiplier=0.5,
        attention_multiplier=0.3, logits_scaling=2.0,
    )  # fmt: skip
    pair = load_pair(cls, config)  # save_pretrained, then from_pretrained twice
    assert pair[1].config.embedding_multiplier == 12.0
    assert isinstance(pipeline_spec_for(pair[1]).stage_forward, AnatomyStageForward)
    data = common.batches(name, 2)
    _check(name, 2, 2, 1, "1f1b", 2, None, "torch", model_pair=pair, data=data, optimizer=common.adamw)


CHECKS = [
    check_granite_with_its_multipliers_pp2_is_exact_through_the_anatomy_route,
    check_llama_sequence_classification_pp2_on_right_padded_batches,
    check_llama_question_answering_pp2_gets_its_span,
    check_llama_tp2_pp2_zero1_with_activation_checkpointing,
    check_tied_llama_tp2_pp2_zero2,
    check_mixtral_tp2_pp2_zero1,
    check_qwen3_tp2_pp2_zero1,
    check_sequence_parallel_llama_tp2_pp2_zero2,
]
test_engine_from_plan_4_ranks = check_table(CHECKS, 4)
