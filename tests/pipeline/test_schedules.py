"""Schedules with several model chunks per pipeline rank (interleaved 1F1B, ZBV, DualPipeV) on Llama, Qwen3,
GPT-2 and T5 (an encoder-decoder in chunks of one layer), and ZeRO-3 on plan-route models at pp=2, through ParallelEngine on 4 gloo ranks, against one process training the
unsharded model on the same batches: the loss of every step and every weight after the steps (with
gradient clipping, so the gradient norm over the chunks is checked too). One spawn; the refusals run
without one.
"""

import pytest
import torch
import transformers as tf

from shardformer import EngineConfig, ParallelEngine
from shardformer.cli.config_file import ConfigError, build_config
from shardformer.cli.main import main
from shardformer.core.counting import CollectiveCounter
from shardformer.core.tiny import tiny_config
from shardformer.engine import split_batch
from shardformer.pipeline.bubble import bubble_fraction, simulate
from shardformer.pipeline.schedule import order as schedule_order
from shardformer.pipeline.virtual import check_virtual, chunk_ranks
from shardformer.tools.pair_check import load_pair
from tests.context_parallel import common as cp_common
from tests.helpers import assert_close, check_table
from tests.pipeline import common
from tests.pipeline.test_engine import STEPS, _check
from tests.zero.test_zero3 import _on_dp


def _llama(name="LlamaForCausalLM", **config):
    cls = getattr(tf, name)
    return load_pair(cls, tiny_config(cls.config_class, num_hidden_layers=common.LAYERS, **config))


def _train(name, combo, pair=None, **options):
    return _check(name, *combo, model_pair=pair or _llama(name), data=common.batches(name, STEPS), **options)


def _inference_matches(engine, ref, name):
    """eval_step and forward walk the chunks (our send/recv) and give the unsharded model's results."""
    batch = common.batches(name, 1, seed=5)[0]
    chunks = split_batch(batch, engine.mesh.dp_size * engine.config.num_microbatches, "chunks")
    with torch.no_grad():
        expected = sum(ref.eval()(**c).loss for c in chunks).item() / len(chunks)
        logits = ref(input_ids=batch["input_ids"]).logits
    assert_close(torch.tensor(engine.eval_step(batch)), torch.tensor(expected), what=f"{name} eval_step")
    assert_close(engine.forward({"input_ids": batch["input_ids"]}), logits, what=f"{name} forward logits")


def check_llama_tp2_pp2_interleaved_and_inference():
    ref, model = pair = _llama(tie_word_embeddings=False)
    engine = _train("LlamaForCausalLM", (2, 2, 1, "interleaved_1f1b", 4, 0.5, "torch"), pair, gather_output=True)
    assert engine.chunks.indices == ((0, 2) if engine.mesh.pp_rank == 0 else (1, 3)), engine.chunks
    _inference_matches(engine, ref, "LlamaForCausalLM")


def check_tied_llama_tp2_pp2_zbv_zero2_sequence_parallel():
    """V-shaped: rank 0 holds the first and the last chunk, the tied embedding once, used by both."""
    ref, model = pair = _llama(tie_word_embeddings=True)
    engine = _train(
        "LlamaForCausalLM", (2, 2, 1, "zbv", 4, 0.5, "torch"), pair, zero_stage=2, sequence_parallel=True,
        gather_output=True,
    )  # fmt: skip
    assert engine.chunks.indices == ((0, 3) if engine.mesh.pp_rank == 0 else (1, 2)), engine.chunks
    assert not engine._torch_pipeline.split_backward  # tp's gradient hooks: the input step runs the whole backward
    _inference_matches(engine, ref, "LlamaForCausalLM")  # the last chunk's outputs come from rank 0


def check_qwen3_tp2_pp2_dualpipev_with_checkpointing():
    _train(
        "Qwen3ForCausalLM", (2, 2, 1, "dualpipev", 4, 0.5, "torch"), _llama("Qwen3ForCausalLM"),
        activation_checkpointing=True,
    )  # fmt: skip


def check_gpt2_pp2_dp2_zbv_split_backward():
    """A built-in family, tied embedding on rank 0; no gradient hooks at tp=1: torch's own weight step."""
    engine = _check("GPT2LMHeadModel", 1, 2, 2, "zbv", 4, 0.5, "torch", zero_stage=2)
    assert engine._torch_pipeline.split_backward


def check_gpt2_cp2_pp2_dualpipev():
    """Context parallelism inside the chunks of a hand-written stage forward (GPT-2's)."""
    ref, model = cp_common.pair("gpt2", n_layer=common.LAYERS)
    data = [cp_common.batch(13, rows=4, seed=s) for s in range(STEPS)]
    engine = ParallelEngine(model, common.sgd, EngineConfig(cp=2, pp=2, schedule="dualpipev", num_microbatches=4))
    got = [engine.train_step(b) for b in data]
    assert_close(torch.tensor(got), torch.tensor(common.reference_run(ref, data, 4)), what="cp2 pp2 dualpipev: losses")
    weights, _ = common.gathered_weights(engine.model, engine.mesh.tp_group)
    for key, value in ref.named_parameters():
        assert_close(weights[key], value.detach(), what=f"cp2 pp2 dualpipev: {key} after {STEPS} steps")


def check_zero3_pp2_dp2_plan_route():
    """ZeRO-3 (FSDP2 over dp) on plan-route models in pipeline stages, one chunk per rank and two."""
    for name, schedule in (("LlamaForCausalLM", "1f1b"), ("Qwen3ForCausalLM", "zbv")):
        _train(name, (1, 2, 2, schedule, 4, 0.5, "torch"), _llama(name), zero_stage=3)
    ref, model = pair = _llama(tie_word_embeddings=True)
    with CollectiveCounter() as counter:
        engine = _train("LlamaForCausalLM", (1, 2, 2, "interleaved_1f1b", 2, 0.5, "torch"), pair, zero_stage=3)
    # each chunk's layers once per step (in the chunk's last backward); the root (embedding, tied head,
    # norm) in every backward that reaches its parameters: 2 micro-batches x the chunks using it
    scatters, _ = _on_dp(counter, engine, "reduce_scatter")
    root_uses = 2 * sum(c in (0, engine.chunks.num_chunks - 1) for c in engine.chunks.indices)
    assert scatters == STEPS * (common.LAYERS // 2 + root_uses), (scatters, engine.chunks)
    _inference_matches(engine, ref, "LlamaForCausalLM")


def _t5():
    cls = tf.T5ForConditionalGeneration
    return load_pair(cls, tiny_config(cls.config_class, num_layers=2, num_decoder_layers=2, decoder_start_token_id=0))


def _train_t5(combo, optimizer=common.adamw, **options):
    """A 2+2-layer T5 in 4 chunks of one layer: cut inside the encoder (T5's position bias handed on with
    the hidden states), at the boundary and inside the decoder (the encoder's output carried along)."""
    ref, model = pair = _t5()
    engine = _check("T5", *combo, model_pair=pair, data=common.batches("T5", 2), optimizer=optimizer, **options)
    return ref, engine


def check_t5_tp2_pp2_interleaved_zero2_and_inference():
    """The shared embedding on three chunks (encoder's, decoder's, head's) over two ranks: one weight."""
    ref, engine = _train_t5(
        (2, 2, 1, "interleaved_1f1b", 2, 0.5, "torch"), common.sgd, zero_stage=2, gather_output=True
    )
    assert engine.chunks.layers == (((0,), (2,)) if engine.mesh.pp_rank == 0 else ((1,), (3,)))
    batch = common.batches("T5", 1, seed=5)[0]
    chunks = split_batch(batch, 2, "chunks")
    with torch.no_grad():
        expected = sum(ref.eval()(**c).loss for c in chunks).item() / len(chunks)
        logits = ref(**batch).logits
    assert_close(torch.tensor(engine.eval_step(batch)), torch.tensor(expected), what="T5 eval_step")
    assert_close(engine.forward(batch), logits, what="T5 forward logits")


def check_t5_pp2_dp2_zbv_adamw():
    _, engine = _train_t5((1, 2, 2, "zbv", 4, 0.5, "torch"))
    assert not engine._torch_pipeline.split_backward  # chunks hand received tensors on: one whole backward


def check_t5_pp2_dp2_dualpipev_zero3():  # both stacks' layers are FSDP2 units; the root's embedding in 3 chunks
    _train_t5((1, 2, 2, "dualpipev", 4, 0.5, "torch"), zero_stage=3)


CHECKS = [
    check_t5_tp2_pp2_interleaved_zero2_and_inference,
    check_t5_pp2_dp2_zbv_adamw,
    check_t5_pp2_dp2_dualpipev_zero3,
    check_llama_tp2_pp2_interleaved_and_inference,
    check_tied_llama_tp2_pp2_zbv_zero2_sequence_parallel,
    check_gpt2_cp2_pp2_dualpipev,
    check_qwen3_tp2_pp2_dualpipev_with_checkpointing,
    check_gpt2_pp2_dp2_zbv_split_backward,
    check_zero3_pp2_dp2_plan_route,
]
test_schedules_4_ranks = check_table(CHECKS, 4)


def test_chunk_placement():
    assert chunk_ranks("loop", 3, 6) == [0, 1, 2, 0, 1, 2]
    assert chunk_ranks("v", 3, 6) == [0, 1, 2, 2, 1, 0]


@pytest.mark.parametrize(
    "options, match",
    [
        ({"schedule": "1f1b", "virtual_stages": 2}, "virtual_stages=2 with schedule='1f1b'"),
        ({"schedule": "zbv", "virtual_stages": 3}, "exactly 2 chunks per rank"),
        ({"schedule": "dualpipev", "backend": "p2p"}, "torch.distributed.pipelining only"),
        ({"schedule": "interleaved_1f1b", "compile": True}, "compile=True"),
    ],
)
def test_config_refusals(options, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(pp=2, **options)


@pytest.mark.parametrize(
    "args, match",
    [
        (("interleaved_1f1b", 4, 2, 9, 8), "num_microbatches=9 .* 2 rounds.*multiple of pp \\(8\\)"),
        (("zbv", 2, 2, 2, 8), "at least 2\\*pp-1=3"),
        (("dualpipev", 2, 2, 3, 8), "at least as many micro-batches as chunks \\(2\\*pp=4\\)"),
        (("interleaved_1f1b", 2, 3, 2, 4), "6 chunks, more than the model's 4 layers"),
        (("zbv", 2, 2, 4, 8, [4, 4]), "one count per chunk, pp \\* virtual_stages = 4"),
    ],
)
def test_schedule_refusals(args, match):
    with pytest.raises(ValueError, match=match):
        check_virtual(*args)


def test_interleaved_counts():
    assert EngineConfig(pp=2, schedule="interleaved_1f1b").chunks_per_rank == 2
    assert EngineConfig(pp=2, schedule="interleaved_1f1b", virtual_stages=3).chunks_per_rank == 3
    assert EngineConfig(pp=1, schedule="zbv").chunks_per_rank == 1  # nothing to interleave
    assert check_virtual("interleaved_1f1b", 2, 2, 4, 6) == [1, 2, 2, 1]  # the middle chunks first, as stages


def test_config_file_keys():
    """The config file (and ``--set``) selects the schedule; the examples pass it to EngineConfig."""
    cfg = build_config({"schedule": "interleaved_1f1b", "virtual_stages": 3})
    assert (cfg.schedule, cfg.virtual_stages) == ("interleaved_1f1b", 3)
    assert build_config({}).schedule == EngineConfig.schedule
    with pytest.raises(ConfigError, match="schedule='zb' is not one of"):
        build_config({"schedule": "zb"})


def test_plan_reports_the_bubble(capsys):
    """``shardformer plan`` prints the chosen schedule's bubble, and refuses what the schedule refuses."""
    assert (
        main(["plan", "gpt2", "--pp", "2", "--summary", "--microbatches", "8", "--schedule", "interleaved_1f1b"]) == 0
    )
    assert (
        "pipeline bubble: 5.9% of each step idle per rank (interleaved_1f1b, 2 chunks per rank"
        in capsys.readouterr().out
    )
    assert main(["plan", "gpt2", "--pp", "4", "--summary", "--microbatches", "4"]) == 0
    assert f"pipeline bubble: {3 / 7:.1%}" in capsys.readouterr().out  # (pp-1) / (m + pp-1)
    assert main(["plan", "gpt2", "--pp", "2", "--summary", "--schedule", "dualpipev", "--microbatches", "2"]) == 2
    assert "DualPipeV needs at least as many micro-batches as chunks" in capsys.readouterr().err


def test_bubble_counted_from_actions():
    """The replay of a schedule's actions gives the formula where it holds: 1F1B at pp=2, 4 micro-batches."""
    order = {r: [(r, kind, i) for kind, i in schedule_order("1f1b", 4, r, 2)] for r in range(2)}
    assert simulate(order) == pytest.approx({0: 0.2, 1: 0.2})
    assert bubble_fraction("1f1b", 2, 4) == pytest.approx(0.2)
    assert bubble_fraction("interleaved_1f1b", 4, 8, 3) == pytest.approx(3 / 27)
