"""`shardformer plan --search`: the layouts a model admits, sized, ranked by the documented cost model,
the top confirmed on simulated ranks and its route proven; a model that cannot fit says what would."""

import pytest
import transformers as tf

from shardformer.cli.main import main
from shardformer.core.config import EngineConfig
from shardformer.pipeline.bubble import WHOLE_BACKWARD, bubble_fraction, replay, schedule_actions
from shardformer.tools.plan import build_meta_model
from shardformer.tools.search import search
from shardformer.tools.search_cost import Hardware, RankState, pipeline_step, step_cost
from shardformer.tools.search_proof import prove_route
from shardformer.tools.search_report import format_search
from shardformer.tools.search_space import Layout, dp_splits, enumerate_layouts, model_shape

SEQ = 32


def _llama(folder, layers: int = 4) -> str:
    config = tf.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    config.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _llama(tmp_path_factory.mktemp("llama"))


def test_the_answer_known_by_hand(llama):
    """Two nodes of one GPU, compute free, no latency, links of beta = 1 GB/s: only traffic counts, 8
    sequences of 32 tokens a step. dp=2 moves the gradients once a step (ZeRO-2: fp32 reduce-scatter,
    4N/2 bytes out; ZeRO-1: an all-reduce, 4N) and the parameters back (bf16 all-gather, 2N/2). pp=2
    sends one micro-batch's activation (b x 32 x 64 x 2 bytes) forward and its gradient back per
    micro-batch, and 1F1B's step is (m + pp - 1) forward-backward pairs: 8 micro-batches of 1 take
    18 x 4096 / beta, less than dp's, tp's all-reduces or cp's key/value passes (each by hand below;
    the collectives counted on gloo ranks by benchmarks/plan_search_check.py --count)."""
    beta = 1e9
    hw = Hardware("by hand", 1e30, 1.0, beta, 0.0, beta, 0.0)
    options = dict(seq=SEQ, global_batch=8, gpus_per_node=1, hardware=hw, simulate=False, prove=False)
    result = search(llama, 2, 2**30, **options)
    best = result.ranked[0]
    assert best.layout.engine_fields("bf16") == {"pp": 2, "dp": 1, "num_microbatches": 8, "precision": "bf16"}
    assert best.cost.step == pytest.approx(18 * 1 * SEQ * 64 * 2 / beta, rel=1e-6)
    assert best.cost.tokens_per_s == pytest.approx(8 * SEQ / best.cost.step)
    assert all(c.peak <= result.usable for c in result.ranked) and len(result.ranked) == 3
    out = format_search(result)
    assert "EngineConfig(pp=2, dp=1, num_microbatches=8, precision='bf16')" in out and "why #2 lost:" in out
    assert "shardformer run --nnodes 2 --nproc_per_node 1" in out
    # the other layouts' costs, by hand: every collective on a 1 GB/s link, nothing else counts
    n = sum(p.numel() for p in build_meta_model(llama).parameters())
    shape, state = model_shape(build_meta_model(llama)), RankState(n, 0, n // 4)
    cost = lambda **kw: step_cost(Layout(**kw), shape, state, SEQ, "bf16", hw, 1).step  # noqa: E731
    assert cost(tp=1, pp=1, dp=2, micro_batch=4, zero=2) == pytest.approx(3 * n / beta)
    assert cost(tp=1, pp=1, dp=2, micro_batch=4, zero=1) == pytest.approx(5 * n / beta)
    # tp: 4 layers x 4 all-reduces of 8 x 32 x 64 x 2 bytes, each sending (p-1)/p x 2 of them, the
    # embedding's and the head's 2 more, and the loss's 3 of 8 x 32 fp32
    act = 8 * SEQ * 64 * 2
    assert cost(tp=2, pp=1, dp=1, micro_batch=8) == pytest.approx(((4 * 4 + 2) * act + 3 * 8 * SEQ * 4) / beta)
    # cp ring: per layer one pass of this rank's keys and values (8 x 16 tokens x 2 heads x 16 x 2 x 2
    # bytes) forward; backward one with their fp32 gradients (twice the bytes), and the gradients once
    # more; the fp32 gradient all-reduced over the 2 cp ranks once a step
    kv = 8 * 16 * 2 * 16 * 2 * 2
    assert cost(tp=1, pp=1, dp=1, cp=2, micro_batch=8) == pytest.approx((4 * (kv + 3 * kv + 2 * kv) + 4 * n) / beta)
    assert EngineConfig(**best.layout.engine_fields("bf16"), prove=False).pp == 2  # a config the engine takes


def test_a_model_that_cannot_fit_names_the_shortfall_and_what_would_fit(llama, capsys):
    argv = ["plan", llama, "--search", "--gpus", "2", "--gpu-memory", "1MiB", "--seq", str(SEQ), "--no-simulate"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "nothing fits on 2 x 1.0 MiB (0.9 MiB usable)." in out
    assert "smallest shortfall: " in out and " over; it fits on GPUs of " in out
    assert "would fit: 4 GPUs of this memory: " in out or "would fit: 8 GPUs of this memory: " in out
    assert main(["plan", llama, "--search", "--gpus", "2", "--seq", "8"]) == 2  # no --gpu-memory
    assert "--search needs --gpus N, --gpu-memory SIZE and --seq TOKENS" in capsys.readouterr().err
    assert main(["plan", llama, "--search", "--tp", "2", "--gpus", "2", "--gpu-memory", "1GB", "--seq", "8"]) == 2
    assert "--search chooses the layout itself; drop --tp" in capsys.readouterr().err


def test_ep_and_cp_are_offered_only_where_they_apply(llama, tmp_path):
    dense = model_shape(build_meta_model(llama))
    layouts = enumerate_layouts(dense, 8, 8, 16, SEQ, "bf16")
    assert {x.ep for x in layouts} == {1} and {x.cp for x in layouts} >= {1, 2, 4}
    assert {x.zero for x in layouts} == {1, 2, 3} and not any(x.zero == 3 and x.cp > 1 for x in layouts)
    assert all(4 % x.tp == 0 and x.world == 8 for x in layouts)  # tp divides the 4 heads
    assert {x.dp_replicate for x in layouts} == {1}  # one node: no hybrid sharding
    bert = model_shape(build_meta_model("bert-tiny"))
    assert "cannot be split over the sequence" in bert.cp_refused
    assert {x.cp for x in enumerate_layouts(bert, 4, 4, 4, SEQ, "bf16")} == {1}
    moe = tf.MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, architectures=["MixtralForCausalLM"],
    )  # fmt: skip
    moe.save_pretrained(tmp_path)
    shape = model_shape(build_meta_model(str(tmp_path)))
    assert (shape.experts, shape.top_k, shape.moe_layers) == (4, 2, 2) and shape.active_numel < shape.numel
    eps = {(x.ep, x.dp) for x in enumerate_layouts(shape, 8, 8, 16, SEQ, "bf16")}
    assert {ep for ep, _ in eps} == {1, 2, 4} and all(dp % ep == 0 for ep, dp in eps)  # ep divides 4 experts and dp
    across = enumerate_layouts(shape, 16, 4, 16, SEQ, "bf16")  # 4 nodes: hybrid sharding, ep inside its shards
    assert any(x.ep > 1 and x.dp_replicate > 1 for x in across)
    assert all((x.dp // x.dp_replicate) % x.ep == 0 for x in across)  # tp=2: no ep=4 over dp=8 as 4 x 2


def test_hybrid_sharding_wins_across_a_slow_link_and_is_offered_only_across_nodes(tmp_path):
    """2 nodes of 8 GPUs, compute and the links inside a node free, 1 GB/s between nodes; one layer and
    one head (no pp, no tp) and an odd sequence (no cp): dp=16 is the only mesh. Only ZeRO-3 fits in
    400 MiB, hybrid (8 shards) or plain (16). Plain ZeRO-3 over all 16 crosses the slow link with its
    reduce-scatter (15/16 x 4N bytes), its layer gathers (15/16 x 2 bytes x the layer, forward and
    backward) and the gather of the rest (the root unit, once), through a node's 8 NICs at once; hybrid sharding (2 replicas x 8) keeps them inside the
    node and only all-reduces each rank's 1/8 of the fp32 gradient over the 2 replicas, one NIC each:
    2 x 1/2 x 4N/8 = N/2 bytes a step on the slow link."""
    config = tf.LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1, max_position_embeddings=64, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    beta = 1e9
    hw = Hardware("by hand", 1e30, 1.0, 1e30, 0.0, beta, 0.0)
    options = dict(seq=31, global_batch=16, gpus_per_node=8, hardware=hw, simulate=False, prove=False)
    result = search(str(tmp_path), 16, 400 * 2**20, **options)
    best, plain = result.ranked[0], result.ranked[2]
    assert best.layout.engine_fields("bf16") == {"dp": 16, "zero_stage": 3, "precision": "bf16", "dp_replicate": 2}
    assert best.layout.short() == "tp1 pp1 dp16(2x8) z3 mb1x1"
    model = build_meta_model(str(tmp_path))
    n, layer = sum(p.numel() for p in model.parameters()), sum(p.numel() for p in model.model.layers[0].parameters())
    assert best.cost.step == pytest.approx(n / 2 / beta)
    assert (plain.layout.dp_replicate, plain.layout.zero) == (1, 3)
    # plain: the rest (embedding, head, norm) gathered once too, over the slow link
    assert plain.cost.step == pytest.approx(15 / 16 * (4 * n + 2 * 2 * layer + 2 * (n - layer)) / (8 * beta))  # 1.5 x
    # per rank: ZeRO-3's parameters, gradients and Adam state, 1/8 of 16 bytes a parameter, and a gathered
    # layer; ZeRO-1/2 hold the whole bf16 parameters (and ZeRO-1 gradients): over 400 MiB
    assert 16 * n / 8 < best.peak <= result.usable and {c.layout.zero for c in result.ranked} == {3}
    assert "dp_replicate = 2" in format_search(result)
    assert EngineConfig(**best.layout.engine_fields("bf16"), prove=False).dp_replicate == 2
    # offered where a dp group spans nodes: replicate = the nodes spanned or a divisor of them, shard = whole
    # nodes' dp ranks; not within a node, nor where a node holds one dp rank (tp x cp fills it)
    assert dp_splits(16, 8, 1) == [1, 2] and dp_splits(32, 8, 1) == [1, 2, 4] and dp_splits(16, 8, 2) == [1, 2, 4]
    assert dp_splits(8, 8, 1) == [1] and dp_splits(2, 8, 8) == [1] and dp_splits(4, 8, 16) == [1]
    one_node = enumerate_layouts(model_shape(build_meta_model(str(tmp_path))), 8, 8, 16, 31, "bf16")
    assert one_node and {x.dp_replicate for x in one_node} == {1}


def test_a_group_across_nodes_crosses_through_each_nodes_nics(llama):
    """2 nodes of 4 GPUs, 1 GB/s per GPU between nodes, no latency, compute free. dp=8 ZeRO-2 moves its
    fp32 reduce-scatter and bf16 all-gather (7/8 x 6N bytes a rank) through the 4 NICs of each node at
    once (4 GB/s); 2 replicas x 4 shards move only each rank's 1/4 of the fp32 gradient between nodes,
    one NIC each (2 x 1/2 x N bytes). Where the link inside a node is the slower, it sets the pace; a
    pipeline send between nodes goes through one NIC."""
    beta = 1e9
    model = build_meta_model(llama)
    n = sum(p.numel() for p in model.parameters())
    shape, state = model_shape(model), RankState(n, 0, n // 4)

    def cost(intra: float, **kw) -> float:
        hw = Hardware("by hand", 1e30, 1.0, intra, 0.0, beta, 0.0)
        return step_cost(Layout(**kw), shape, state, SEQ, "bf16", hw, 4).step

    assert cost(1e30, tp=1, pp=1, dp=8, zero=2) == pytest.approx(7 / 8 * 6 * n / (4 * beta))
    assert cost(1e30, tp=1, pp=1, dp=8, zero=2, dp_replicate=2) == pytest.approx(n / beta)
    assert cost(2 * beta, tp=1, pp=1, dp=8, zero=2) == pytest.approx(7 / 8 * 6 * n / (2 * beta))  # NVLink-bound
    # pp=2 x dp=4, each stage a node: 8 micro-batches of one 32 x 64 bf16 activation, 1F1B's (m + pp - 1) pairs
    sends = cost(1e30, tp=1, pp=2, dp=4, zero=2, microbatches=8) - cost(1e30, tp=1, pp=1, dp=4, zero=2)
    assert sends == pytest.approx(9 * 2 * SEQ * 64 * 2 / beta)


def test_the_bubble_is_the_schedules_own_action_list():
    for pp, m in ((2, 4), (4, 8)):
        busy, step = replay(schedule_actions("1f1b", pp, m), WHOLE_BACKWARD)
        assert 1 - busy[0] / step == pytest.approx(bubble_fraction("1f1b", pp, m))
        busy, step = replay(schedule_actions("interleaved_1f1b", pp, m, 2), WHOLE_BACKWARD)
        assert 1 - busy[0] / step == pytest.approx(bubble_fraction("interleaved_1f1b", pp, m, 2))
    assert set(schedule_actions("zbv", 2, 4, 2)) == {0, 1}  # torch's own ZBV order, read from its class
    for schedule, pp, m in (("1f1b", 4, 8), ("gpipe", 4, 6), ("1f1b", 8, 3)):  # the closed form is the replay's
        _, step = replay(schedule_actions(schedule, pp, m), {"F": 1.0, "B": 1.7})
        assert pipeline_step(schedule, pp, m, 1, 1.0, 1.7) == pytest.approx(step)


def test_the_top_layouts_are_simulated_and_the_chosen_route_proven(llama):
    result = search(llama, 2, 2**30, seq=SEQ, global_batch=4, simulate=True, prove=False, top=2)
    assert result.simulated >= 2 and 1 <= result.rank_builds <= result.simulated
    assert all(c.simulated for c in result.ranked if c.layout.cp == 1)
    assert "checked on simulated ranks" in format_search(result)
    proof = prove_route(llama, Layout(tp=2, pp=1, dp=1, sequence_parallel=True))
    assert proof.startswith("route '") and "proven exact on a tiny copy at tp=2 with sequence parallelism" in proof
    assert prove_route(llama, Layout(tp=1, pp=1, dp=2)).startswith("tp=1: nothing is cut")
