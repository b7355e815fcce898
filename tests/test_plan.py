"""`shardformer plan` gives exactly the parameter shapes a real tensor-parallel shard has, and an
activation estimate equal to the bytes a real forward keeps for the backward."""

import pytest
import torch
import torch.distributed as dist
import transformers as tf

from shardformer import ShardConfig, shard_model
from shardformer.cli.main import main
from shardformer.tools.activation_estimate import estimate_activations
from shardformer.tools.plan import build_meta_model, plan_model
from shardformer.tools.testing import run_on_ranks
from tests.policies import zoo

NAMES = ["GPT2LMHeadModel", "BertForMaskedLM", "ViTForImageClassification"]


def _real_shapes():
    out = {}
    for name in NAMES:
        _, model = zoo.load_twice(name)
        model = shard_model(model, ShardConfig(tensor_parallel_size=dist.get_world_size()))
        out[name] = {n: (tuple(p.shape), p.numel() * p.element_size()) for n, p in model.named_parameters()}
    out["held vs estimate"] = _held_and_estimated(dist.get_world_size())
    return out


# -- activation memory: the estimate against what a forward really keeps ------------------------

BATCH, SEQ = 2, 64


def _activation_models():
    gpt2 = tf.GPT2Config(
        vocab_size=99, n_embd=128, n_layer=2, n_head=4, n_positions=SEQ, resid_pdrop=0.1, embd_pdrop=0.1,
        attn_pdrop=0.1, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    llama = tf.LlamaConfig(
        vocab_size=99, hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ,
    )  # fmt: skip
    for cls, config, impl in ((tf.GPT2LMHeadModel, gpt2, "eager"), (tf.LlamaForCausalLM, llama, "sdpa")):
        torch.manual_seed(0)
        yield cls._from_config(config, attn_implementation=impl).train()


def _held_bytes(model, ids) -> int:
    """Bytes of the tensors a training forward keeps for the backward: every tensor autograd saved
    (parameters aside), each storage counted once."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids).loss  # noqa: B018 - the step keeps the loss and drops the rest
    return sum(storages.values())


# tp > 1 also with sequence parallelism, re-gathering the column layers' inputs (the default) or keeping them
SEQUENCE_PARALLEL = {
    "": {},
    " + sequence parallel": {"sequence_parallel": True},
    " + sequence parallel (keep gathered)": {"sequence_parallel": True, "sequence_parallel_regather": False},
}


def _held_and_estimated(tp):
    ids = torch.randint(3, 99, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    out = {}
    for suffix, options in SEQUENCE_PARALLEL.items() if tp > 1 else [("", {})]:
        for model in _activation_models():
            if tp > 1:
                model = shard_model(model, ShardConfig(tensor_parallel_size=tp, **options))
            out[model.config.model_type + suffix] = (
                _held_bytes(model, ids),
                estimate_activations(model.config, BATCH, SEQ, tp, **options).total,
            )
    return out


def _assert_estimates(held_and_estimated, tp):
    for kind, (held, estimate) in held_and_estimated.items():
        assert abs(estimate / held - 1) < 0.02, f"{kind} at tp={tp}: estimated {estimate:,} bytes, held {held:,}"


def test_activation_estimate_equals_what_a_forward_keeps_unsharded():
    _assert_estimates(_held_and_estimated(1), 1)


def test_activation_estimate_structure():
    config = next(_activation_models()).config
    est = lambda tp=2, seq=SEQ, **kw: estimate_activations(config, BATCH, seq, tp, sharded=True, **kw)  # noqa: E731
    one, two = est(tp=1), est()
    assert two.layer_split * 2 == one.layer_split and two.layer_whole == one.layer_whole  # tp splits the interior
    sp = est(sequence_parallel=True)  # the column layers' inputs re-gathered in backward: all of it split
    assert sp.layer_whole == two.layer_whole // 2 and sp.layer_split == two.layer_split
    keep = est(sequence_parallel=True, sequence_parallel_regather=False)
    entry_inputs = 2 * BATCH * SEQ * config.n_embd * 4  # the gathered norm outputs the column layers keep
    assert keep.layer_whole - entry_inputs == (two.layer_whole - entry_inputs) // 2
    outside = lambda e: e.parts["final norm + head input"]  # noqa: E731
    assert outside(sp) * 2 == outside(two)  # the final norm runs on the chunk, the head keeps the chunk
    head_input = BATCH * SEQ * config.n_embd * 4  # kept gathered by the head without re-gathering
    assert (outside(keep) - head_input) * 2 == outside(two) - head_input
    ckpt = est(checkpointing=True)
    assert ckpt.parts["layer inputs (checkpointed)"] == config.n_layer * BATCH * SEQ * config.n_embd * 4
    assert ckpt.recompute == two.layer_whole + two.layer_split and ckpt.total < two.total
    assert (
        est(checkpointing=True, sequence_parallel=True).parts["layer inputs (checkpointed)"] * 2
        == (ckpt.parts["layer inputs (checkpointed)"])
    )
    totals = [est(seq=s).total for s in (16, 32, 64, 128)]
    assert totals == sorted(totals) and len(set(totals)) == 4
    with pytest.raises(NotImplementedError, match="model_type='bert'"):
        estimate_activations(zoo.bert_config(), BATCH, SEQ)
    with pytest.raises(ValueError, match="seq=0 must be at least 1"):
        estimate_activations(config, BATCH, 0)


def _saved(name, folder):
    import transformers as tf

    torch.manual_seed(0)
    getattr(tf, name)(zoo.config_for(name)).save_pretrained(folder)
    return str(folder)


def test_plan_matches_a_real_tp2_shard_byte_for_byte(tmp_path):
    real = run_on_ranks(_real_shapes, 2)
    _assert_estimates(real[0].pop("held vs estimate"), 2)
    real[1].pop("held vs estimate")
    for name in NAMES:
        folder = _saved(name, tmp_path / name)
        plan = plan_model(build_meta_model(folder), tp=2)
        planned = {n: (local, int(torch.Size(local).numel()) * 4) for n, _, local in plan.params}
        for rank_shapes in real:
            assert planned == rank_shapes[name], name
        assert plan.rank_numel * 4 == sum(b for _, b in real[0][name].values())
        # the stage split covers every layer once and every parameter at least once
        stages = plan_model(build_meta_model(folder), tp=2, pp=2).stages
        assert [list(layers) for layers, _ in stages] == [[0], [1]]
        assert sum(n for _, n in stages) >= plan.rank_numel


def test_cli_prints_the_plan_and_refuses_sizes_that_do_not_fit(tmp_path, capsys):
    folder = _saved("GPT2LMHeadModel", tmp_path / "gpt2")
    assert main(["plan", folder, "--tp", "2", "--dp", "2", "--zero", "1"]) == 0
    out = capsys.readouterr().out
    assert "Conv1D -> Linear1D_Col" in out and "transformer.wte.weight: [99, 32] -> [50, 32]  [split]" in out
    assert "optimizer (Adam + master)" in out
    assert main(["plan", folder, "--tp", "2", "--pp", "2", "--summary"]) == 0
    out = capsys.readouterr().out
    assert "stage 0: layers 0..0" in out and "stage 1: layers 1..1" in out
    assert main(["plan", folder, "--tp", "3"]) == 2
    assert "num_attention_heads=4 is not divisible by tensor_parallel_size=3" in capsys.readouterr().err
    assert main(["plan", folder, "--tp", "2", "--summary", "--batch", "2", "--seq", "16"]) == 0
    out = capsys.readouterr().out
    assert "activations per rank, batch 2 x seq 16" in out and "+ sequence parallel" in out
    assert main(["plan", folder, "--batch", "2"]) == 2
    assert "give both (--batch and --seq)" in capsys.readouterr().err
    assert main(["plan", "no-such-model"]) == 2
    assert "built-in name" in capsys.readouterr().err
