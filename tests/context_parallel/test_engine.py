"""Context parallelism on 4 ranks: tp=2 x cp=2 against the unsharded model (both modes), and
ParallelEngine with cp composed with ZeRO, data parallelism, activation checkpointing, tensor and
sequence parallelism, and pipeline stages: every step's loss and the weights after the steps equal one process
training the unsharded model on the same batches, with the gradients summed over cp in ZeRO's
buckets (one all-reduce per bucket and step). One spawn.
"""

import pytest
import torch
import torch.distributed as dist

from shardformer import EngineConfig, ParallelEngine, ProcessMesh, ShardConfig, shard_model
from shardformer.core.comm import CollectiveCounter
from shardformer.policies.anatomy_pipeline import AnatomyStageForward
from tests.context_parallel import common, trust
from tests.helpers import assert_close, check_table
from tests.pipeline import common as engine_common

STEPS = 2


def _ranks(group):
    out = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, torch.tensor([dist.get_rank()]), group=group)
    return [int(t) for t in out]


def check_mesh_layout_with_cp():
    """rank = ((pp * dp + d) * cp + c) * tp + t: tp innermost, then cp."""
    rank = dist.get_rank()
    mesh = ProcessMesh(tp_size=2, cp_size=2)
    assert (mesh.cp_rank, mesh.tp_rank, mesh.dp_size) == (rank // 2, rank % 2, 1)
    assert _ranks(mesh.tp_group) == [rank - rank % 2, rank - rank % 2 + 1]
    assert _ranks(mesh.cp_group) == [rank % 2, rank % 2 + 2]
    mesh = ProcessMesh(cp_size=2)  # dp = 4 // 2
    assert (mesh.dp_rank, mesh.cp_rank) == divmod(rank, 2)
    assert _ranks(mesh.cp_group) == [rank - rank % 2, rank - rank % 2 + 1]
    assert _ranks(mesh.dp_group) == [rank % 2, rank % 2 + 2]
    assert mesh.global_rank(0, 1, 0, 1) == 3


def check_llama_tp2_cp2_ring():
    ref, model = common.pair("llama")
    model = shard_model(model, ShardConfig(tensor_parallel_size=2, context_parallel_size=2))
    assert model.shardformer.context_parallel.proven  # the split proven at tp=2 x cp=2 (policies/context_proof.py)
    common.parity(ref, model, common.batch(13), "llama tp=2 cp=2 ring")


def check_qwen3_tp2_cp2_all_to_all():
    # 2 query heads and 1 key/value head per tp rank: keys/values are repeated for the all-to-all
    ref, model = common.pair("qwen3", "eager")
    config = ShardConfig(tensor_parallel_size=2, context_parallel_size=2, context_parallel_mode="all_to_all")
    common.parity(ref, shard_model(model, config), common.batch(16), "qwen3 tp=2 cp=2 all_to_all")


def check_opt_tp2_cp2_derived_route():
    # no transformers tp plan: the derived cut; positions counted over the attention mask (left padding)
    ref, model = common.pair("opt")
    model = shard_model(model, ShardConfig(tensor_parallel_size=2, context_parallel_size=2))
    assert model.shardformer.route == "derived" and model.shardformer.context_parallel.proven, model.shardformer
    common.parity(ref, model, trust.left_padded(13, pad=1), "opt tp=2 cp=2 ring")


def check_tp2_cp2_peers_given_different_batches_raise():
    """cp rank 1 (ranks 2, 3) given a batch of another length: every rank raises before the forward's
    collectives (gloo would abort); tp x cp peers are compared in one gather (core/forward_agreement.py)."""
    ref, model = common.pair("llama")
    model = shard_model(model, ShardConfig(tensor_parallel_size=2, context_parallel_size=2))
    with pytest.raises(RuntimeError) as info:
        model(**common.batch(13 if dist.get_rank() < 2 else 11))
    for part in ("ranks 0, 1, 2, 3 are tensor- and context-parallel peers", "rank 2: [2, 11] int64"):
        assert part in str(info.value), str(info.value)
    same = common.batch(13)
    assert_close(model(**same).loss, ref(**same).loss, what="the same batch after the refusal")


def _engine_run(name, cfg, rows, *collectives):
    ref, model = common.pair(name)
    data = [common.batch(13, rows=rows, seed=s) for s in range(STEPS)]
    engine = ParallelEngine(model, engine_common.sgd, cfg)
    with CollectiveCounter() as counter:
        got = [engine.train_step(b) for b in data]
    assert all(counter.counts[c] > 0 for c in collectives), f"{collectives} did not all run: {counter.counts}"
    # gradients summed over cp in ZeRO's buckets: one all-reduce per bucket and step (not per parameter)
    cp_group = engine.mesh.cp_group
    sums = [n for (op, n, _), g in zip(counter.calls, counter.groups) if op == "all_reduce" and g is cp_group and n > 1]
    assert len(sums) == STEPS * len(engine.optimizer.buckets), (len(sums), len(engine.optimizer.buckets))
    assert engine.model.is_gradient_checkpointing == cfg.activation_checkpointing
    what = f"{name} {cfg}"
    with common.clear_of_kinks(ref, what):
        expected = engine_common.reference_run(ref, data, engine.mesh.dp_size * cfg.num_microbatches)
    assert_close(torch.tensor(got), torch.tensor(expected), what=f"{what}: losses")
    weights, _ = engine_common.gathered_weights(engine.model, engine.mesh.tp_group)
    for key, value in ref.named_parameters():
        assert_close(weights[key], value.detach(), what=f"{what}: {key} after {STEPS} steps")
    return engine


def check_engine_cp2_dp2_zero2_checkpointing():
    cfg = EngineConfig(cp=2, zero_stage=2, activation_checkpointing=True, num_microbatches=2)
    _engine_run("llama", cfg, 4, "send", "reduce_scatter")  # the ring; ZeRO-2's gradients


def check_engine_tp2_cp2_sequence_parallel():
    cfg = EngineConfig(tp=2, cp=2, cp_mode="all_to_all", sequence_parallel=True)
    engine = _engine_run("gpt2", cfg, 2, "all_to_all", "reduce_scatter")  # Ulysses; sequence parallelism
    # a forward with a cache is not split: under autograd its whole gradient would be summed over cp
    with pytest.raises(ValueError, match="train without a cache"):
        engine.model(input_ids=common.batch(8)["input_ids"], use_cache=True)


def check_engine_cp2_pp2_zero1_both_backends():
    # every stage of a cp rank splits the micro-batch the same way; chunk-sized hidden states between stages
    # llama: transformers' pp plan (the model's own forward per stage); gpt2: a hand-written stage forward;
    # opt: the derived route, stages from its anatomy (AnatomyStageForward: the model's own forward per stage)
    runs = [("llama", "p2p", "1f1b", False), ("llama", "torch", "gpipe", True), ("gpt2", "p2p", "1f1b", False)]
    runs.append(("opt", "p2p", "1f1b", False))
    for name, backend, schedule, checkpointing in runs:
        cfg = EngineConfig(
            cp=2, pp=2, backend=backend, schedule=schedule, zero_stage=1, num_microbatches=2,
            activation_checkpointing=checkpointing,
        )  # fmt: skip
        engine = _engine_run(name, cfg, 2, "send")  # the ring (and p2p between stages)
        assert engine.mesh.pp_size == 2 and len(list(engine.model.shardformer.layers)) == 1
        if name == "opt":
            assert isinstance(engine.pipeline.stage_forward, AnatomyStageForward), engine.pipeline.stage_forward


test_cp_4_ranks = check_table(
    [
        check_mesh_layout_with_cp,
        check_llama_tp2_cp2_ring,
        check_qwen3_tp2_cp2_all_to_all,
        check_opt_tp2_cp2_derived_route,
        check_tp2_cp2_peers_given_different_batches_raise,
        check_engine_cp2_dp2_zero2_checkpointing,
        check_engine_tp2_cp2_sequence_parallel,
        check_engine_cp2_pp2_zero1_both_backends,
    ],
    4,
)
